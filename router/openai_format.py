"""OpenAI response shapes: full responses, stream chunks, SSE framing, the error JSON.

Every response also carries `slos_serve`: what the cluster did with the request (verdict,
replica, hops, SLO attainment per stage), since OpenAI's schema has no place for it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from cluster.api import FinalRecord, Placement, Verdict
from replica.batch import TokenLogprob
from router.errors import ApiError
from router.frontdoor import Finished, Output
from router.openai_schema import Echo, Endpoint
from router.reasoning import ReasoningParser, ReasoningStream
from router.tools import ToolCalling, ToolOutput
from router.wire import HEADER_HOPS, HEADER_REPLICA, HEADER_VERDICT

SSE_DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0


class Spelling(Protocol):
    """How log-probabilities name a token."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: a piece of a character, whose text is U+FFFD, gives its
        piece, so that the pieces join into the character (what OpenAI's `bytes` is for)."""
        ...


class TokenIds:
    """vLLM's `return_tokens_as_token_ids`: each token named `token_id:<id>`, which a client
    can map back to its token where the text of a piece of a character is U+FFFD."""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event; compact JSON never holds a raw newline, so one data line is enough."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_body(error: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.status,
        }
    }


def service_tier(records: Sequence[FinalRecord]) -> str:
    return "flex" if any(r.verdict is Verdict.BEST_EFFORT for r in records) else "default"


def abort_reason(record: FinalRecord) -> str:
    """Why the request ended as aborted, as far as the server knows ("" otherwise)."""
    return record.reason if record.finish_reason == "abort" else ""


def cluster_info(record: FinalRecord) -> dict[str, Any]:
    """A choice's `slos_serve`; with `abort_reason` when it was aborted for a known reason."""
    info: dict[str, Any] = {
        "verdict": record.verdict.value,
        "replica": record.replica,
        "hops": record.hops,
        "migrations": record.migrations,
        "slo_attained": record.slo_attained,
        "stages": [
            {
                "name": s.name,
                "attained": s.attained,
                "late_tokens": s.late_tokens,
                "tokens": s.tokens,
            }
            for s in record.stages
        ],
    }
    reason = abort_reason(record)
    if reason:
        info["abort_reason"] = reason
    return info


def cluster_summary(records: Sequence[FinalRecord]) -> dict[str, Any]:
    """A response's `slos_serve`: its one choice's, or, over several choices (each of which
    carries its own), the weakest verdict, the replica if they share one, the most hops, all
    migrations, and a stage attained only where every choice attained it."""
    if len(records) == 1:
        return cluster_info(records[0])
    replicas = {r.replica for r in records}
    attained = [r.slo_attained for r in records]
    return {
        "verdict": _weakest(r.verdict for r in records).value,
        "replica": replicas.pop() if len(replicas) == 1 else None,
        "hops": max(r.hops for r in records),
        "migrations": sum(r.migrations for r in records),
        "slo_attained": None if None in attained else all(attained),
        "stages": [
            {
                "name": same[0].name,
                "attained": all(s.attained for s in same),
                "late_tokens": sum(s.late_tokens for s in same),
                "tokens": sum(s.tokens for s in same),
            }
            for same in zip(*(r.stages for r in records), strict=False)
        ],
    }


def _weakest(verdicts: Iterable[Verdict]) -> Verdict:
    return (
        Verdict.BEST_EFFORT if any(v is Verdict.BEST_EFFORT for v in verdicts) else Verdict.ADMITTED
    )


def placement_headers(placements: Sequence[Placement | None]) -> dict[str, str]:
    """Where the choices were bound: HTTP headers of a stream (sent with the first token) and
    gRPC initial metadata, so a client that stops reading early still learns the verdict.
    Several choices give the weakest verdict, the most hops, and the replica if they share one."""
    known = [p for p in placements if p is not None]
    if not known:
        return {}
    headers = {
        HEADER_VERDICT: _weakest(p.verdict for p in known).value,
        HEADER_HOPS: str(max(p.hops for p in known)),
    }
    replicas = {p.replica for p in known}
    if len(replicas) == 1:
        headers[HEADER_REPLICA] = str(replicas.pop())
    return headers


def cluster_headers(summary: dict[str, Any]) -> dict[str, str]:
    """Response headers of a finished (non-streamed) response, from its `cluster_summary`."""
    headers = {HEADER_VERDICT: summary["verdict"], HEADER_HOPS: str(summary["hops"])}
    if summary["replica"] is not None:
        headers[HEADER_REPLICA] = str(summary["replica"])
    if summary["slo_attained"] is not None:
        headers["x-slos-serve-slo-attained"] = str(summary["slo_attained"]).lower()
    return headers


def usage(
    records: Sequence[FinalRecord], n: int, thinking: Sequence[int | None] = ()
) -> dict[str, Any]:
    """Each prompt counted once, however many samples (`n`) it had, as OpenAI counts; of
    them, the tokens the prefix cache held, as OpenAI reports its own cache's; of the output,
    the thinking's tokens (`thinking`: each choice's, None without a reasoning parser)."""
    prompt = sum(r.num_prompt_tokens for r in records[::n])
    completion = sum(r.num_output_tokens for r in records)
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in records[::n])},
    }
    counts = [t for t in thinking if t is not None]
    if counts:
        body["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
    return body


def logprobs_json(
    endpoint: Endpoint,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob | None],
    spelling: Spelling,
    offset: int = 0,
) -> tuple[dict[str, Any] | None, int]:
    """A choice's (or a chunk's) `logprobs` in the endpoint's OpenAI form, or None when the
    request asked for none; and the text offset after its tokens (completions' `text_offset`
    counts each token's text from `offset`). A None entry is a token without one (an echoed
    prompt's first)."""
    if not logprobs:
        return None, offset
    entries = [None if lp is None else _finite(lp) for lp in logprobs]
    if endpoint is Endpoint.CHAT:
        content = [
            {
                **_token_entry(spelling, token, lp.logprob),
                "top_logprobs": [_token_entry(spelling, t, v) for t, v in lp.top],
            }
            for token, lp in zip(token_ids, entries, strict=True)
            if lp is not None
        ]
        return {"content": content, "refusal": None}, offset
    texts = [spelling.token_text(t) for t in token_ids]
    offsets = list(itertools.accumulate((len(t) for t in texts), initial=offset))
    top = [
        None
        if lp is None
        else _by_text([*((spelling.token_text(t), v) for t, v in lp.top), (text, lp.logprob)])
        for text, lp in zip(texts, entries, strict=True)
    ]
    completion = {
        "tokens": texts,
        "token_logprobs": [None if lp is None else lp.logprob for lp in entries],
        "top_logprobs": top,
        "text_offset": offsets[:-1],
    }
    return completion, offsets[-1]


def echoed(
    echo: Echo | None, output: Output, spelling: Spelling
) -> tuple[str, dict[str, Any] | None]:
    """A completion choice's text and `logprobs`, led by its prompt when `echo` asks: with
    log-probabilities, the prompt's tokens come first, the first without one."""
    text, token_ids = output.text, output.token_ids
    logprobs: list[TokenLogprob | None] = []
    if echo is not None:
        text = echo.text + text
        if echo.logprobs:
            token_ids = (*echo.token_ids, *token_ids)
            logprobs = [None, *output.prompt_logprobs]
    logprobs += output.logprobs
    return text, logprobs_json(Endpoint.COMPLETIONS, token_ids, logprobs, spelling)[0]


def _finite(logprob: TokenLogprob) -> TokenLogprob:
    """JSON has no -inf (a masked or underflowed token): floored as vLLM does."""
    top = tuple((t, max(v, LOGPROB_FLOOR)) for t, v in logprob.top)
    return replace(logprob, logprob=max(logprob.logprob, LOGPROB_FLOOR), top=top)


def prompt_logprobs_json(
    prompt: Sequence[int], values: Sequence[TokenLogprob], spelling: Spelling
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none), the token's own value
    and rank, then its likeliest alternatives by rank, keyed by token id."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, value in zip(prompt[1:], values, strict=True):
        value = _finite(value)
        entry = {str(token): _ranked(value.logprob, value.rank, spelling.token_text(token))}
        for rank, (alternative, logprob) in enumerate(value.top, 1):
            text = spelling.token_text(alternative)
            entry.setdefault(str(alternative), _ranked(logprob, rank, text))
        out.append(entry)
    return out


def _ranked(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


def _by_text(entries: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Completions' legacy form keys alternatives by text: tokens that decode alike (pieces
    of a character) keep the highest value."""
    merged: dict[str, float] = {}
    for text, value in entries:
        merged[text] = max(value, merged.get(text, value))
    return merged


def _token_entry(spelling: Spelling, token: int, logprob: float) -> dict[str, Any]:
    return {
        "token": spelling.token_text(token),
        "logprob": logprob,
        "bytes": list(spelling.token_bytes(token)),
    }


def full_response(
    endpoint: Endpoint,
    response_id: str,
    created: int,
    model: str,
    outputs: Sequence[Output],
    n: int,
    spelling: Spelling,
    echo: Sequence[Echo] = (),
    tools: ToolCalling | None = None,
    prompts: Sequence[Sequence[int]] = (),
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    """The non-streamed body of a finished request: one choice per output, in order (each
    led by its prompt when `echo` has one per choice, its thinking apart when `reasoning`
    says how the model marks it, made tool calls when `tools` says, with vLLM's
    `prompt_logprobs` of its prompt when `prompts` has one per choice: per choice for
    completions, once for chat's one prompt)."""
    records = [o.record for o in outputs]
    choices = []
    for index, output in enumerate(outputs):
        choice: dict[str, Any] = {"index": index}
        finish_reason = output.record.finish_reason
        if endpoint is Endpoint.CHAT:
            thought, text = (
                (None, output.text) if reasoning is None else reasoning.split(output.text)
            )
            made = None if tools is None else tools.message(text)
            if made is None:
                answer = (echo[index].text if echo else "") + text
                # All thinking and no answer: null content, as vLLM's reasoning parsers give.
                empty = reasoning is not None and not answer
                choice["message"] = {"role": "assistant", "content": None if empty else answer}
            else:
                assert tools is not None
                content, calls = made
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = tools.finish_reason(finish_reason)
            if reasoning is not None and reasoning.include:
                # Null when empty, as a stream sends no empty delta.
                choice["message"]["reasoning_content"] = thought or None
            logprobs, _ = logprobs_json(endpoint, output.token_ids, output.logprobs, spelling)
        else:
            choice["text"], logprobs = echoed(echo[index] if echo else None, output, spelling)
        choice |= {
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": output.stop_reason,
        }
        if prompts and endpoint is Endpoint.COMPLETIONS:
            choice["prompt_logprobs"] = prompt_logprobs_json(
                prompts[index], output.prompt_logprobs, spelling
            )
        if len(outputs) > 1:
            choice["slos_serve"] = cluster_info(output.record)
        choices.append(choice)
    chat_prompt: dict[str, Any] = {}
    if prompts and endpoint is Endpoint.CHAT:
        chat_prompt["prompt_logprobs"] = prompt_logprobs_json(
            prompts[0], outputs[0].prompt_logprobs, spelling
        )
    return {
        "id": response_id,
        "object": "chat.completion" if endpoint is Endpoint.CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(records, n, [o.reasoning_tokens for o in outputs]),
        "service_tier": service_tier(records),
        "slos_serve": cluster_summary(records),
        **chat_prompt,
    }


class ChoiceText:
    """One choice's output as it streams through either door: the thinking apart when the
    request has a reasoning parser, and only the content a tool call cannot start when its
    calls are held until whole ("required", "auto")."""

    @staticmethod
    def splits(tools: ToolCalling | None, reasoning: ReasoningParser | None) -> bool:
        """Whether the text is taken apart: thinking from the answer, or content from calls
        held until whole; else it goes out as it comes (content, or a named function's
        arguments)."""
        return reasoning is not None or (tools is not None and tools.held_to_end)

    def __init__(self, tools: ToolCalling | None, reasoning: ReasoningParser | None) -> None:
        if reasoning is not None and tools is not None and not tools.held_to_end:
            # The request parser drops the reasoning parser wherever a grammar holds the output.
            raise ValueError("a named function's output is its arguments: it has no thinking")
        self.output = None if tools is None else ToolOutput(tools)
        self.thinking = None if reasoning is None else ReasoningStream(reasoning)

    def add(self, text: str) -> tuple[str, str]:
        """The (thinking, content) the output's next text lets out."""
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
        return thought, (text if self.output is None else self.output.content(text))

    def finish(
        self, reason: str | None
    ) -> tuple[str, str, list[dict[str, Any]] | None, str | None]:
        """What is still held when the output ends, (thinking, content), the calls it made
        (None: none) and the finish reason to report."""
        thought, text = ("", "") if self.thinking is None else self.thinking.finish()
        if self.output is None:
            return thought, text, None, reason
        content = self.output.content(text)
        rest, calls, reason = self.output.finish(reason)
        return thought, content + rest, calls, reason


class ChunkWriter:
    """Builds the SSE events of one streamed response, in OpenAI's chunk format.

    Tool calls stream as OpenAI's deltas: a named function's arguments as they come (its id
    and name in the first); the array `tool_choice: "required"` makes, once it is whole (its
    text cannot be split into calls before), each call in one delta; with "auto", the text as
    content until a call may start, then the calls, each in one delta, at the end (or the
    rest as content when it made none). With a reasoning parser, the thinking streams as
    `reasoning_content` and only the answer as content (or calls)."""

    def __init__(
        self,
        endpoint: Endpoint,
        response_id: str,
        created: int,
        model: str,
        spelling: Spelling,
        tools: ToolCalling | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.response_id = response_id
        self.created = created
        self.model = model
        self.spelling = spelling
        self.tools = tools
        self.role_sent: set[int] = set()
        self.offsets: dict[int, int] = {}
        """Per choice: the text offset its next token's log-probability starts at."""
        self.reasoning = reasoning
        self.splits = ChoiceText.splits(tools, reasoning)
        self.choices: dict[int, ChoiceText] = {}
        """Per choice whose text is split (`splits`): where its output stands."""

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = "chat.completion.chunk" if self.endpoint is Endpoint.CHAT else "text_completion"
        payload = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return sse_event(payload)

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        stop_reason: str | int | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`delta`: a chat chunk's own, instead of what `text` makes."""
        choice: dict[str, Any] = {"index": index}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = text
        else:
            choice["delta"] = self._delta(index, text) if delta is None else delta
            if index not in self.role_sent:
                choice["delta"]["role"] = "assistant"
                self.role_sent.add(index)
        return choice | {
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def _delta(self, index: int, text: str) -> dict[str, Any]:
        """A chat chunk's delta: its thinking, and its text or what it adds to the calls."""
        if self.splits:
            thought, content = self._choice_text(index).add(text)
            return _with_reasoning(thought, {"content": content} if content else {})
        if self.tools is None:
            return {"content": text}
        if index not in self.role_sent:  # the call's id and name, with its first arguments
            return {"tool_calls": [{"index": 0, **self.tools.named_call(text)}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _choice_text(self, index: int) -> ChoiceText:
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = ChoiceText(self.tools, self.reasoning)
        return choice

    def text(
        self,
        index: int,
        text: str,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprob | None] = (),
    ) -> bytes:
        """Choice `index`'s next text, with its tokens' log-probabilities when asked for
        (nothing while it only adds to calls held until whole)."""
        offset = self.offsets.get(index, 0)
        payload, self.offsets[index] = logprobs_json(
            self.endpoint, token_ids, logprobs, self.spelling, offset
        )
        choice = self._choice(index, text, None, payload)
        if choice.get("delta") == {} and payload is None:
            return b""
        return self._chunk([choice])

    def finish(self, index: int, finished: Finished) -> bytes:
        """Choice `index`'s last chunk: its finish and stop reasons, and what the cluster did
        with it (after the calls "required" made, now whole)."""
        record = finished.record
        reason = record.finish_reason
        before = b""
        if self.splits:  # what was held: the end of a marker never completed, calls' content
            thought, text, made, reason = self._choice_text(index).finish(reason)
            # Content held from calls goes out even empty when nothing else carries the role.
            alone = self.tools is not None and not thought and index not in self.role_sent
            delta = _with_reasoning(thought, {"content": text} if text or alone else {})
            if delta:
                before = self._chunk([self._choice(index, "", None, delta=delta)])
            if made is not None:
                delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(made)]}
                before += self._chunk([self._choice(index, "", None, delta=delta)])
        last = self._chunk(
            [self._choice(index, "", reason, None, finished.stop_reason)],
            service_tier=service_tier([record]),
            slos_serve=cluster_info(record),
        )
        self.choices.pop(index, None)
        return before + last

    def done(self, finished: Sequence[Finished], n: int, include_usage: bool) -> bytes:
        """After every choice finished (`finished`, in choice order): the usage chunk if asked
        for, then [DONE]."""
        if include_usage:
            records = [f.record for f in finished]
            thinking = [f.reasoning_tokens for f in finished]
            return self._chunk([], usage=usage(records, n, thinking)) + SSE_DONE
        return SSE_DONE

    def error(self, error: ApiError) -> bytes:
        """An error after the stream started (status already sent): an error event, then [DONE]."""
        return sse_event(error_body(error)) + SSE_DONE


def _with_reasoning(thought: str, delta: dict[str, Any]) -> dict[str, Any]:
    return {"reasoning_content": thought, **delta} if thought else delta
