"""Both doors on the real cluster (demo pair, 2 replicas, backup policy: reject).

HTTP is driven by the official `openai` package (and httpx for raw headers); gRPC by our SDK
plus the standard health and reflection clients.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from replica.request import SLO
from router.client import (
    AsyncClient,
    CallTool,
    ChatMessage,
    Chunk,
    Client,
    ClientError,
    Result,
    StructuredOutputs,
    Tool,
)
from router.gen.slos_serve.v1 import serving_pb2 as pb
from router.gen.slos_serve.v1 import serving_pb2_grpc as pb_grpc
from router.local import LocalFrontDoor
from tests.router.bodies import ascii_headers, bodies
from tests.router.conftest import API_KEY, TENANT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Once upon a time"
IMPOSSIBLE = {"ttft_ms": 0.001, "tpot_ms": 0.001}
"""No replica can promise a first token within a microsecond: the backup policy rejects."""


@pytest.fixture(scope="module")
def oai(live: LocalFrontDoor) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy_text(oai: openai.OpenAI) -> str:
    out = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_completion(oai: openai.OpenAI, live: LocalFrontDoor, greedy_text: str) -> None:
    out = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_text and out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens == len(live.door.codec.encode(PROMPT))
    info = out.model_extra["slos_serve"]
    assert info["verdict"] == "admitted" and info["replica"] in (0, 1) and info["hops"] >= 1


def test_streamed_completion_equals_unstreamed(oai: openai.OpenAI, greedy_text: str) -> None:
    stream = oai.completions.create(
        model="demo", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert all(c.choices for c in chunks)  # no usage chunk unless asked, as OpenAI
    assert "".join(c.choices[0].text for c in chunks) == greedy_text
    asked = list(
        oai.completions.create(
            model="demo",
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.total_tokens > 0


def test_a_seed_gives_the_same_text_on_either_replica_streamed_or_not(oai: openai.OpenAI) -> None:
    """Sampled (temperature 0.9) and speculating: the seed alone fixes the text."""
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0.9)
    texts, replicas = set(), set()
    for _ in range(4):
        out = oai.completions.create(**body, seed=1234)
        texts.add(out.choices[0].text)
        replicas.add(out.model_extra["slos_serve"]["replica"])
    stream = oai.completions.create(**body, seed=1234, stream=True)
    texts.add("".join(c.choices[0].text for c in stream if c.choices))
    assert len(texts) == 1 and replicas == {0, 1}, (texts, replicas)
    other = oai.completions.create(**body, seed=4321)
    assert other.choices[0].text not in texts


def test_a_stop_string_inside_a_token_cuts_the_text_right_before_it(
    oai: openai.OpenAI, live: LocalFrontDoor
) -> None:
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    full = oai.completions.create(**body).choices[0].text
    ids = live.door.codec.encode(full)
    starts = {len(live.door.codec.decode(ids[:n])) for n in range(len(ids) + 1)}
    at = next(i for i in range(1, len(full) - 2) if i not in starts and full.find(full[i]) == i)
    stop = full[at : at + 2]
    assert full.find(stop) == at
    out = oai.completions.create(**body, stop=stop)
    assert out.choices[0].text == full[:at] and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    streamed = list(oai.completions.create(**body, stop=[stop, "\u2603"], stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:at]
    assert streamed[-1].choices[0].model_extra["stop_reason"] == stop
    kept = oai.completions.create(
        **body, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == full[: at + len(stop)]


def grpc_tokens(live: LocalFrontDoor, **options: Any) -> tuple[str, list[int]]:
    text, ids, _ = grpc_generate(live, **options)
    return text, ids


def grpc_generate(
    live: LocalFrontDoor, messages: list[Any] | None = None, **options: Any
) -> tuple[str, list[int], Result]:
    """The text, ids and Result of PROMPT's completion, or of a chat of `messages`."""
    with Client(live.grpc_target, api_key=API_KEY) as client:
        items = list(client.generate(None if messages else PROMPT, messages=messages, **options))
    chunks = [c for c in items if isinstance(c, Chunk)]
    assert isinstance(items[-1], Result)
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], items[-1]


def test_penalties_and_bias_reach_the_engine_through_either_door(
    oai: openai.OpenAI, live: LocalFrontDoor
) -> None:
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    plain = oai.completions.create(**body).choices[0].text
    shaping: dict[str, Any] = dict(frequency_penalty=1.5, presence_penalty=0.5)
    x = live.door.codec.encode("x")[0]
    shaped = oai.completions.create(**body, **shaping, logit_bias={str(x): 4}).choices[0].text
    assert shaped != plain
    streamed = oai.completions.create(**body, **shaping, logit_bias={str(x): 4}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == shaped
    text, _ = grpc_tokens(live, max_tokens=24, temperature=0.0, logit_bias={x: 4.0}, **shaping)
    assert text == shaped


def test_structured_output_through_either_door(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """A JSON schema over chat (OpenAI's response_format, streamed or not), a choice list
    (vLLM's structured_outputs) sampled, and a regex over gRPC: each output follows it and
    ends with it."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    body: dict[str, Any] = dict(
        model="demo",
        messages=[{"role": "user", "content": "Describe a function as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}},
    )
    out = oai.chat.completions.create(**body)
    content = out.choices[0].message.content
    assert content is not None and out.choices[0].finish_reason == "stop"
    value = json.loads(content)
    assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    streamed = oai.chat.completions.create(**body, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
    choices = ["return a", "pass", "yield b"]
    picked = oai.completions.create(
        model="demo",
        prompt=PROMPT,
        max_tokens=16,
        temperature=1.5,
        n=4,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    regex = StructuredOutputs(regex=r"[a-c]{2,5}!")
    text, _, result = grpc_generate(live, max_tokens=16, structured_outputs=regex)
    assert re.fullmatch(r"[a-c]{2,5}!", text) and result.finish_reason == "stop"


def test_a_grammar_the_model_can_no_longer_follow_ends_aborted_saying_why(
    oai: openai.OpenAI, live: LocalFrontDoor
) -> None:
    """llguidance gives up on a{1000000} after a token or two: the client learns why its
    output ended as aborted, on either door, and the metrics count it by that reason."""
    out = oai.completions.create(
        model="demo",
        prompt=PROMPT,
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "a{1000000}"}},
    )
    assert out.choices[0].finish_reason == "abort"
    why = out.model_extra["slos_serve"]["abort_reason"]  # type: ignore[index]
    assert why.startswith("the output can no longer follow its grammar: ")
    regex = StructuredOutputs(regex="a{1000000}")
    _, _, result = grpc_generate(live, max_tokens=16, structured_outputs=regex)
    assert (result.finish_reason, result.abort_reason) == ("abort", why)
    metrics = httpx.get(live.http_url + "/metrics", timeout=10).text
    assert re.search(
        r'requests_finished_total\{finish_reason="abort",model="demo",tenant="[^"]+"\} [2-9]',
        metrics,
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find a name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def streamed_calls(stream: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """Tool calls put together from a chat stream's deltas, as OpenAI clients do, its finish
    reason and its content."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    content = ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish, content


def test_tool_calls_named_or_required_streamed_or_not(oai: openai.OpenAI) -> None:
    """A named function's arguments follow its schema; "required" makes one or more calls of
    the tools; a conversation carrying calls and their results goes on."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Who wrote this?"}]
    named = {"type": "function", "function": {"name": "lookup"}}
    body: dict[str, Any] = dict(model="demo", messages=messages, max_tokens=48, temperature=0)
    out = oai.chat.completions.create(**body, tools=TOOLS, tool_choice=named)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "lookup" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"name"} and len(arguments["name"]) <= 8
    stream = oai.chat.completions.create(**body, tools=TOOLS, tool_choice=named, stream=True)
    calls, finish, content = streamed_calls(stream)
    assert finish == "stop" and len(calls) == 1 and not content
    assert (calls[0]["name"], calls[0]["arguments"]) == ("lookup", call.function.arguments)
    required = oai.chat.completions.create(**body, tools=TOOLS, tool_choice="required")
    made = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason == "tool_calls" and made
    assert all(c.function.name in ("lookup", "now") for c in made)
    for c in made:
        json.loads(c.function.arguments)
    stream = oai.chat.completions.create(**body, tools=TOOLS, tool_choice="required", stream=True)
    calls, finish, content = streamed_calls(stream)
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in made
    ]
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Guido"},
    ]
    answer = oai.chat.completions.create(
        model="demo", messages=history, max_tokens=4, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_grpc_tool_calls_match_http(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """Over gRPC the chunks carry the content only and the Result the calls: the same calls
    HTTP makes (greedy), for a named tool, "required" and "auto"; a history carrying them
    goes on."""
    tools = [
        Tool(
            t["function"]["name"],
            t["function"].get("description", ""),
            t["function"].get("parameters"),
        )
        for t in TOOLS
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Who wrote this?"}]
    body: dict[str, Any] = dict(model="demo", messages=messages, max_tokens=48, temperature=0)
    named = {"type": "function", "function": {"name": "lookup"}}
    regex = (
        r'Sure\.<tool_call>\{"name": "lookup", "arguments": \{"name": "[a-z]{1,6}"\}\}</tool_call>'
    )
    forced = {"structured_outputs": {"regex": regex}}
    for choice, http_choice, extra, content in (
        (CallTool("lookup"), named, {}, ""),
        ("required", "required", {}, ""),
        (None, None, forced, "Sure."),
    ):
        http_args = {} if http_choice is None else {"tool_choice": http_choice}
        http = oai.chat.completions.create(**body, tools=TOOLS, **http_args, extra_body=extra)
        want = [
            (c.function.name, c.function.arguments)
            for c in http.choices[0].message.tool_calls or []
        ]
        grpc_extra = {"structured_outputs": StructuredOutputs(regex=regex)} if extra else {}
        text, ids, result = grpc_generate(
            live,
            [("user", "Who wrote this?")],
            max_tokens=48,
            temperature=0.0,
            tools=tools,
            tool_choice=choice,
            **grpc_extra,
        )
        assert want and [(c.name, c.arguments) for c in result.tool_calls] == want
        assert text == content and len(ids) == result.completion_tokens
        assert result.finish_reason == http.choices[0].finish_reason
        assert all(c.id.startswith("chatcmpl-tool-") for c in result.tool_calls)
    call = result.tool_calls[0]
    history = [
        ("user", "Who wrote this?"),
        ChatMessage("assistant", tool_calls=[call]),
        ChatMessage("tool", "Guido", tool_call_id=call.id),
    ]
    text, _, result = grpc_generate(
        live, history, max_tokens=4, temperature=0.0, tools=tools, tool_choice="none"
    )
    assert text and not result.tool_calls


def test_auto_tool_calls_are_read_out_of_the_text(oai: openai.OpenAI) -> None:
    """With the deployment's hermes parser, "auto" (the default with tools) leaves the output
    free: the demo model writes text, which stays content; an output that writes a call (here
    forced by the request's own regex) comes back as the call, streamed or not."""
    messages = [{"role": "user", "content": "Who wrote this?"}]
    body: dict[str, Any] = dict(model="demo", messages=messages, max_tokens=24, temperature=0)
    plain = oai.chat.completions.create(**body, tools=TOOLS)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    regex = (
        r'Sure\.<tool_call>\{"name": "lookup", "arguments": \{"name": "[a-z]{1,6}"\}\}</tool_call>'
    )
    forced = dict(**body, tools=TOOLS, extra_body={"structured_outputs": {"regex": regex}})
    forced["max_tokens"] = 64
    out = oai.chat.completions.create(**forced)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"name"}
    calls, finish, content = streamed_calls(oai.chat.completions.create(**forced, stream=True))
    assert finish == "tool_calls" and content == "Sure."
    assert [(c["name"], c["arguments"]) for c in calls] == [("lookup", call.function.arguments)]


def test_a_stop_token_id_ends_the_text_before_its_own_after_min_tokens(
    oai: openai.OpenAI, live: LocalFrontDoor
) -> None:
    """Like EOS: the token is counted and its text left out; min_tokens holds it back."""
    _, ids = grpc_tokens(live, max_tokens=24, temperature=0.0, ignore_eos=True)
    stop = next(t for t in ids[2:] if live.door.codec.decode([t]).strip())
    at = ids.index(stop)
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=0)
    out = oai.completions.create(**body, extra_body={"stop_token_ids": [stop]})
    assert out.choices[0].text == live.door.codec.decode(ids[:at])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    assert out.usage is not None and out.usage.completion_tokens == at + 1
    held = oai.completions.create(
        **body, extra_body={"stop_token_ids": [stop], "min_tokens": at + 2}
    )
    assert held.usage is not None and held.usage.completion_tokens >= at + 2
    text, held_ids, result = grpc_generate(
        live, max_tokens=24, temperature=0.0, stop_token_ids=[stop], min_tokens=at + 2
    )
    assert text == held.choices[0].text and stop not in held_ids[: at + 1]
    assert result.stop_reason == (stop if result.finish_reason == "stop" else None)
    _, _, ended = grpc_generate(live, max_tokens=24, temperature=0.0, stop_token_ids=[stop])
    assert (ended.finish_reason, ended.stop_reason) == ("stop", stop)


def test_chat_stream_with_usage(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
    full = oai.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
    )
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content


def test_flex_is_served_best_effort(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        service_tier="flex",
        temperature=0,
    )
    assert out.service_tier == "flex"
    assert out.model_extra["slos_serve"]["verdict"] == "best_effort"
    assert out.model_extra["slos_serve"]["slo_attained"] is None


def test_several_prompts_and_samples_in_one_request(
    oai: openai.OpenAI, live: LocalFrontDoor, greedy_text: str
) -> None:
    """Two prompts x n = 2 from the OpenAI SDK: choice i * 2 + j is prompt i's sample j, each
    served as its own request; the stream's chunks carry their choice's index and join to the
    same texts."""
    other = "The little dog"
    body: dict[str, Any] = dict(
        model="demo", prompt=[PROMPT, other], n=2, max_tokens=8, temperature=0
    )
    out = oai.completions.create(**body)
    texts = [c.text for c in out.choices]
    alone = [
        oai.completions.create(model="demo", prompt=p, max_tokens=8, temperature=0)
        for p in (PROMPT, other)
    ]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert texts == [greedy_text] * 2 + [alone[1].choices[0].text] * 2
    assert out.usage is not None and all(a.usage is not None for a in alone)
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    infos = [c.model_extra["slos_serve"] for c in out.choices]
    assert all(i["verdict"] == "admitted" and i["slo_attained"] for i in infos), infos
    assert out.model_extra["slos_serve"]["verdict"] == "admitted"
    joined, finished = [""] * 4, set()
    for chunk in oai.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    ):
        for choice in chunk.choices:
            joined[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
        usage = chunk.usage
    assert joined == texts and finished == {0, 1, 2, 3}
    assert usage is not None and usage.total_tokens == out.usage.total_tokens


def test_n_seeded_samples_differ_and_each_is_reproducible(oai: openai.OpenAI) -> None:
    """Sample j of a request seeded s is the request seeded s + j (vLLM's rule)."""
    messages = [{"role": "user", "content": PROMPT}]
    body: dict[str, Any] = dict(model="demo", messages=messages, max_tokens=16, temperature=0.9)
    out = oai.chat.completions.create(**body, n=2, seed=77)
    first, second = (c.message.content for c in out.choices)
    assert first != second
    assert oai.chat.completions.create(**body, seed=78).choices[0].message.content == second
    roles, joined = [None, None], ["", ""]
    for chunk in oai.chat.completions.create(**body, n=2, seed=77, stream=True):
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            joined[choice.index] += choice.delta.content or ""
    assert roles == ["assistant", "assistant"] and joined == [first, second]


def test_grpc_samples_with_logprobs_match_http(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """n seeded samples through the SDK: chunks told apart by index, a Result per choice,
    each token's log-probability; the same texts and values as the HTTP door gives."""
    http = oai.completions.create(
        model="demo", prompt=PROMPT, max_tokens=12, temperature=0.9, n=2, seed=5, logprobs=2
    )
    with Client(live.grpc_target, api_key=API_KEY) as client:
        items = list(
            client.generate(PROMPT, max_tokens=12, temperature=0.9, n=2, seed=5, logprobs=2)
        )
        single = client.complete(PROMPT, max_tokens=12, temperature=0.9, seed=5, logprobs=0)
    results = sorted((i for i in items if isinstance(i, Result)), key=lambda r: r.index)
    assert [r.index for r in results] == [0, 1] and isinstance(items[-1], Result)
    first = items[0]
    assert isinstance(first, Chunk) and first.placement is not None
    replicas = {r.replica for r in results}
    assert first.placement.replica == (replicas.pop() if len(replicas) == 1 else None)
    for choice in http.choices:
        chunks = [c for c in items if isinstance(c, Chunk) and c.index == choice.index]
        assert "".join(c.text for c in chunks) == choice.text
        logprobs = [lp for c in chunks for lp in c.logprobs]
        assert (
            len(logprobs)
            == sum(len(c.token_ids) for c in chunks)
            == results[choice.index].completion_tokens
        )
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert [lp.logprob for lp in logprobs] == pytest.approx(choice.logprobs.token_logprobs)
        assert all(len(lp.top) == 2 for lp in logprobs)
    assert single.text == http.choices[0].text
    assert len(single.logprobs) == single.result.completion_tokens
    assert all(lp.top == () for lp in single.logprobs)


def test_a_refused_choice_stops_the_others(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """The test profile lets a replica hold one request of a 100 ms TPOT, not two: of three
    choices, two are admitted (one per replica) and the third is refused, so the request gets
    429 and the two admitted choices are stopped by the door, not left to run (nor left to
    the garbage collector): counted lost, given up by the server, not cancelled, as if their
    client had left."""
    url = live.http_url + "/v1/cluster/status"
    before = httpx.get(url, headers=auth(), timeout=30).json()["counters"]
    lost, cancelled = admitted_ended(live, "lost"), admitted_ended(live, "cancelled")
    with pytest.raises(openai.RateLimitError):
        oai.completions.create(
            model="demo",
            prompt=PROMPT,
            n=3,
            max_tokens=1500,
            extra_body={"slo": {"ttft_ms": 5000, "tpot_ms": 100}, "ignore_eos": True},
        )
    status = wait_until_idle(live)
    assert all(rep["running"] == 0 for rep in status["replicas"]), status
    assert status["counters"]["admitted"] - before.get("admitted", 0) == 2, status
    assert admitted_ended(live, "lost") - lost == 2
    assert admitted_ended(live, "cancelled") == cancelled


def admitted_ended(live: LocalFrontDoor, how: str) -> float:
    """Admitted requests counted `how` (lost: ended by the server; cancelled: by the client)."""
    text = httpx.get(live.http_url + "/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"slos_serve:requests_{how}_total" and s.labels["verdict"] == "admitted"
    )


def test_logprobs_of_every_token_streamed_or_not(oai: openai.OpenAI) -> None:
    """Greedy: each token is its row's most likely one, so its log-probability heads its
    alternatives; the tokens spell the text; a stream's chunks carry the same values."""
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    out = oai.completions.create(**body, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert len(logprobs.tokens) == out.usage.completion_tokens
    for token, lp, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert lp <= 0 and lp == max(top.values()) and top[token] == lp and len(top) <= 3
    streamed = [
        c.choices[0].logprobs
        for c in oai.completions.create(**body, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert [lp for s in streamed for lp in s.token_logprobs] == pytest.approx(
        logprobs.token_logprobs, abs=1e-6
    )
    assert [o for s in streamed for o in s.text_offset] == logprobs.text_offset
    chat = oai.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    assert oai.completions.create(**body).choices[0].logprobs is None


def test_echo_with_logprobs_scores_a_prompt_as_an_evaluation_harness_asks(
    oai: openai.OpenAI, live: LocalFrontDoor, target_dir: Path
) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1): the
    text and log-probabilities start with the prompt's, which are the model's own."""
    from transformers import AutoModelForCausalLM

    body: dict[str, Any] = dict(
        model="demo", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    out = oai.completions.create(**body)
    ids = live.door.codec.encode(PROMPT)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and choice.logprobs is not None
    values = choice.logprobs.token_logprobs
    assert values is not None and len(values) == len(ids) + 1 and values[0] is None
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits[:-1], dim=-1)
    prompt_values = [expected[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert values[1 : len(ids)] == pytest.approx(prompt_values, abs=1e-3)
    streamed = list(oai.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    stream_values = [
        v
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for v in c.choices[0].logprobs.token_logprobs or ()
    ]
    assert stream_values == values
    alone = oai.completions.create(**{**body, "max_tokens": 0})
    assert alone.choices[0].text == PROMPT and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs is not None
    assert alone.choices[0].logprobs.token_logprobs == values[: len(ids)]
    assert alone.usage is not None and alone.usage.completion_tokens == 0
    streamed_alone = list(oai.completions.create(**{**body, "max_tokens": 0}, stream=True))
    assert "".join(c.choices[0].text for c in streamed_alone if c.choices) == PROMPT


def test_prompt_logprobs_as_vllm_reports_them(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """Per prompt token after the first: its own value and rank, then its likeliest
    alternatives by rank, keyed by token id; the values are echo's. Chat reports them once
    for its prompt; a stream cannot carry them."""
    body: dict[str, Any] = dict(model="demo", prompt=PROMPT, max_tokens=2, temperature=0)
    out = oai.completions.create(**body, extra_body={"prompt_logprobs": 2})
    listed = out.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    prompt = live.door.codec.encode(PROMPT)
    assert listed[0] is None and len(listed) == len(prompt)
    echoed = oai.completions.create(**body, echo=True, logprobs=0).choices[0].logprobs
    assert echoed is not None and echoed.token_logprobs is not None
    values = echoed.token_logprobs[1 : len(prompt)]
    for token, entry, value in zip(prompt[1:], listed[1:], values, strict=True):
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(value) and own["rank"] >= 1
        assert own["decoded_token"] == live.door.codec.token_text(token)
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) in (2, 3)
    chat = httpx.post(
        live.http_url + "/v1/chat/completions",
        json={
            "model": "demo",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
        headers=auth(),
        timeout=60,
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(
        len(e) == 1 for e in chat["prompt_logprobs"][1:]
    )
    for refused in ({"stream": True}, {"echo": True, "logprobs": 1}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            oai.completions.create(**body, **refused, extra_body={"prompt_logprobs": 1})


def test_a_continued_assistant_message_is_echoed_before_its_continuation(
    oai: openai.OpenAI,
) -> None:
    """vLLM's chat echo with continue_final_message: the content is the whole message,
    streamed or not; echo on a conversation ending with the user's turn adds nothing."""
    started = [
        {"role": "user", "content": "Write a function."},
        {"role": "assistant", "content": "def f("},
    ]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    body: dict[str, Any] = dict(model="demo", messages=started, max_tokens=6, temperature=0)
    alone = oai.chat.completions.create(**body, extra_body=continued).choices[0].message.content
    whole = oai.chat.completions.create(**body, extra_body={**continued, "echo": True})
    assert alone is not None and whole.choices[0].message.content == "def f(" + alone
    stream = oai.chat.completions.create(
        **body, stream=True, extra_body={**continued, "echo": True}
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "def f(" + alone
    )
    plain = dict(model="demo", messages=started[:1], max_tokens=4, temperature=0)
    assert (
        oai.chat.completions.create(**plain, extra_body={"echo": True}).choices[0].message.content
        == oai.chat.completions.create(**plain).choices[0].message.content
    )


def test_headers_say_what_the_cluster_did(live: LocalFrontDoor) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2}
    headers = {**auth(), "x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "1000"}
    r = httpx.post(live.http_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-slos-serve-verdict"] == "admitted"
    assert (
        r.headers["x-slos-serve-replica"] in ("0", "1") and int(r.headers["x-slos-serve-hops"]) >= 1
    )
    streamed = {**body, "stream": True, "max_tokens": 6}
    with httpx.stream(
        "POST", live.http_url + "/v1/completions", json=streamed, headers=headers, timeout=60
    ) as s:
        announced = [s.headers[f"x-slos-serve-{k}"] for k in ("verdict", "replica", "hops")]
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    info = next(e["slos_serve"] for e in events if "slos_serve" in e)
    assert announced == [info["verdict"], str(info["replica"]), str(info["hops"])]


def test_errors_have_the_right_status(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="demo", prompt="x", max_tokens=-3)
    assert bad.value.body["param"] == "max_tokens"
    anonymous = openai.OpenAI(base_url=live.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model="demo", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        oai.completions.create(
            model="demo", prompt="x", max_tokens=2, extra_body={"slo": IMPOSSIBLE}
        )
    assert int(limited.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):  # all choices or none
        oai.completions.create(
            model="demo", prompt=["x", "y"], n=2, max_tokens=2, extra_body={"slo": IMPOSSIBLE}
        )
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="demo", prompt="x", n=2, best_of=3, max_tokens=1)
    assert bad.value.body["param"] == "best_of"
    r = httpx.post(
        live.http_url + "/v1/completions", content=b"{not json", headers=auth(), timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        live.http_url + "/v1/completions", content=b"[[[[" * 5000, headers=auth(), timeout=30
    )
    assert r.status_code == 400
    r = httpx.post(
        live.http_url + "/v1/completions",
        content=b'{"model": "demo", "prompt": "x", "guided_json": {"const": NaN}}',
        headers=auth(),
        timeout=30,
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    lone_surrogates = [
        ("/v1/completions", b'{"model": "demo", "prompt": "\\ud800"}'),
        ("/v1/completions", b'{"model": "demo", "prompt": "x", "\\udfff": 1}'),
        (
            "/v1/chat/completions",
            b'{"model": "demo", "messages": [{"role": "user", "content": "a\\ud800"}]}',
        ),
    ]
    for path, content in lone_surrogates:
        r = httpx.post(live.http_url + path, content=content, headers=auth(), timeout=30)
        assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"]


def test_tokenize_and_detokenize(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    """vLLM's endpoints: the count a completion's usage reports, and the text back."""
    with httpx.Client(base_url=live.http_url, headers=auth(), timeout=30) as http:
        counted = http.post("/tokenize", json={"model": "demo", "prompt": PROMPT}).json()
        messages = [{"role": "user", "content": "hi"}]
        chat = http.post("/tokenize", json={"model": "demo", "messages": messages}).json()
        back = http.post("/detokenize", json={"model": "demo", "tokens": counted["tokens"]})
        refused = http.post("/tokenize", json={"model": "demo", "prompt": 3})
        unknown = http.post("/detokenize", json={"model": "gpt-4", "tokens": [1]})
        anonymous = httpx.post(live.http_url + "/tokenize", json={"model": "demo", "prompt": "x"})
    out = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=1)
    assert out.usage is not None and counted["count"] == out.usage.prompt_tokens
    assert counted["max_model_len"] == live.door.schema.max_model_len
    reply = oai.chat.completions.create(model="demo", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens
    assert back.json() == {"prompt": PROMPT}
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert (unknown.status_code, anonymous.status_code) == (404, 401)


def test_models_health_status_metrics(oai: openai.OpenAI, live: LocalFrontDoor) -> None:
    assert [m.id for m in oai.models.list()] == ["demo"]
    assert oai.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    assert httpx.get(live.http_url + "/health", timeout=30).json()["status"] == "ok"
    status = httpx.get(live.http_url + "/v1/cluster/status", headers=auth(), timeout=30).json()
    assert status["model"] == "demo" and len(status["replicas"]) == 2
    anonymous = httpx.get(live.http_url + "/v1/cluster/status", timeout=30)
    assert (anonymous.status_code, anonymous.headers["www-authenticate"]) == (401, "Bearer")
    text = httpx.get(live.http_url + "/metrics", timeout=30).text
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    admitted = values[
        ("slos_serve:requests_admitted_total", (("model", "demo"), ("tenant", TENANT)))
    ]
    assert admitted == status["counters"]["admitted"]
    running = [v for (name, _), v in values.items() if name == "slos_serve:num_requests_running"]
    assert len(running) == 2


def test_grpc_sdk_streams_the_same_text(live: LocalFrontDoor, greedy_text: str) -> None:
    with Client(live.grpc_target, api_key=API_KEY) as client:
        items = list(client.generate(PROMPT, max_tokens=8, temperature=0.0, slo="chat"))
        status = client.cluster_status()
    chunks = [i for i in items if isinstance(i, Chunk)]
    result = items[-1]
    assert isinstance(result, Result) and result.verdict == "admitted"
    placement = chunks[0].placement
    assert placement is not None and all(c.placement is None for c in chunks[1:])
    assert (placement.verdict, placement.replica, placement.hops) == (
        result.verdict,
        result.replica,
        result.hops,
    )
    assert "".join(c.text for c in chunks) == greedy_text
    assert sum(len(c.token_ids) for c in chunks) == result.completion_tokens
    assert result.ttft_s is not None and result.ttft_s > 0 and len(status.replicas) == 2


def test_usage_counts_the_prompt_tokens_a_prefix_cache_held(
    oai: openai.OpenAI, live: LocalFrontDoor
) -> None:
    """The same prompt four times over round-robin replicas (best-effort: the synthetic
    profile prices its prefill past the tier's TTFT): a replica that computed it before
    serves its whole blocks from the cache, and says so in the usage, over HTTP as over gRPC
    (the first time a replica sees the prompt, nothing is cached)."""
    prompt = "The fox that the usage counted jumped over the lazy dog again. " * 4
    size = len(live.door.codec.encode(prompt))
    assert size > 32
    cached = []
    for _ in range(2):
        out = oai.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            extra_body={"service_tier": "flex"},
        )
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    with Client(live.grpc_target, api_key=API_KEY) as client:
        for _ in range(2):
            items = client.generate(prompt, max_tokens=2, temperature=0.0, service_tier="flex")
            result = list(items)[-1]
            assert isinstance(result, Result) and result.prompt_tokens == size
            cached.append(result.cached_tokens)
    assert cached[0] == 0 and max(cached) == (size - 1) // 16 * 16
    assert all(c in (0, (size - 1) // 16 * 16) for c in cached)


def test_grpc_status_codes(live: LocalFrontDoor) -> None:
    with Client(live.grpc_target) as client, pytest.raises(ClientError) as info:
        client.complete(PROMPT, max_tokens=2)
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
    with Client(live.grpc_target, api_key=API_KEY) as client:
        with pytest.raises(ClientError) as info:
            client.complete(PROMPT, max_tokens=2, top_p=7.0)
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.details
        with pytest.raises(ClientError) as info:
            client.complete(PROMPT, structured_outputs=StructuredOutputs(regex="a(b"))
        assert info.value.details.startswith("structured_outputs.regex: at")  # named once
        with pytest.raises(ClientError) as info:
            client.complete(PROMPT, max_tokens=2, model="gpt-4")
        assert info.value.code is grpc.StatusCode.NOT_FOUND
        with pytest.raises(ClientError) as info:
            client.complete(PROMPT, max_tokens=2, slo=SLO(**IMPOSSIBLE))
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.retry_after_s is not None and info.value.retry_after_s > 0


def test_grpc_async_client_and_standard_services(live: LocalFrontDoor) -> None:
    async def run() -> Result:
        async with AsyncClient(live.grpc_target, api_key=API_KEY) as client:
            done = await client.complete(PROMPT, max_tokens=3, service_tier="flex")
        return done.result

    result = asyncio.run(run())
    assert result.verdict == "best_effort" and result.slo_attained is None
    with grpc.insecure_channel(live.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="slos_serve.v1.Serving"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        names = {s.name for s in reply.list_services_response.service}
        assert {"slos_serve.v1.Serving", "grpc.health.v1.Health"} <= names


def test_client_disconnect_aborts_the_request(live: LocalFrontDoor) -> None:
    body = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    several = {**body, "n": 2, "max_tokens": 900}  # both fit one replica's KV
    for sent in (body, several):
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST", live.http_url + "/v1/completions", json=sent, headers=auth()
            ) as r,
        ):
            assert r.status_code == 200
            next(r.iter_lines())
        status = wait_until_idle(live)
        assert all(rep["running"] == 0 for rep in status["replicas"]), status
    metrics = httpx.get(live.http_url + "/metrics", timeout=30).text
    cancelled = f'slos_serve:requests_cancelled_total{{model="demo",tenant="{TENANT}",'
    assert any(line.startswith(cancelled) for line in metrics.splitlines()), metrics[-2000:]


ABORT_WITHIN_S = 1.5
"""Well under the time a 1500-token request takes by itself: at least 3.3 s on the demo
profile's 2.2 ms per decode step, so only an abort can make the replicas idle this soon."""


def wait_until_idle(live: LocalFrontDoor) -> dict[str, Any]:
    """Poll the cluster until no replica runs or queues anything, for ABORT_WITHIN_S."""
    deadline = time.monotonic() + ABORT_WITHIN_S
    while True:
        status: dict[str, Any] = httpx.get(
            live.http_url + "/v1/cluster/status", headers=auth(), timeout=30
        ).json()
        idle = all(rep["running"] == 0 and rep["waiting"] == 0 for rep in status["replicas"])
        if idle or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_sdk_cancel_and_deadline_free_the_request(live: LocalFrontDoor) -> None:
    long = {"max_tokens": 1500, "ignore_eos": True}
    with Client(live.grpc_target, api_key=API_KEY) as client:
        stream = client.generate(PROMPT, **long)
        assert isinstance(next(stream), Chunk)
        stream.close()
        status = wait_until_idle(live)
        assert all(rep["running"] == 0 for rep in status["replicas"]), status
        with pytest.raises(ClientError) as info:
            client.complete(PROMPT, timeout_s=0.5, **long)
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    status = wait_until_idle(live)
    assert all(rep["running"] == 0 for rep in status["replicas"]), status


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Keep fuzzed requests short: a valid large max_tokens would only cost time."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 8 < value < 100_000:
            body[key] = 8
    body.pop("ignore_eos", None)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 128:
        body["n"] = 2
    return body


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    body=bodies,
    hdrs=ascii_headers,
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_fuzzed_http_bodies_never_get_a_5xx(
    live: LocalFrontDoor, body: dict[str, Any], hdrs: dict[str, str], path: str
) -> None:
    response = httpx.post(
        live.http_url + path,
        content=json.dumps(_bounded(body)),
        headers={**hdrs, **auth(), "Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code < 500, response.text


uint32 = st.integers(min_value=0, max_value=2**32 - 1)
doubles = st.floats(allow_nan=True, allow_infinity=True)
grpc_requests = st.builds(
    pb.GenerateRequest,
    model=st.sampled_from(["demo", "demo", "other", ""]),
    prompt=st.text(max_size=40),
    prompt_token_ids=st.lists(uint32, max_size=4),
    max_tokens=st.integers(min_value=0, max_value=8) | st.integers(5000, 2**32 - 1),
    temperature=doubles,
    top_p=doubles,
    top_k=uint32,
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    stop=st.lists(st.text(max_size=4), max_size=2),
    slo=st.builds(
        pb.SLO,
        ttft_ms=doubles,
        tpot_ms=doubles,
        stages=st.lists(st.builds(pb.Stage, tpot_ms=doubles, num_tokens=uint32), max_size=2),
        tier=st.sampled_from(["", "chat", "gold"]),
    ),
    service_tier=st.integers(min_value=0, max_value=5),
    priority=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    structured_outputs=st.builds(pb.StructuredOutputs, regex=st.text(max_size=8))
    | st.builds(pb.StructuredOutputs, choice=st.lists(st.text(max_size=4), max_size=2))
    | st.builds(pb.StructuredOutputs, json=st.text(max_size=20))
    | st.builds(pb.StructuredOutputs, grammar=st.text(max_size=12)),
)
CLEAN_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=grpc_requests)
def test_fuzzed_grpc_requests_fail_cleanly(live: LocalFrontDoor, request: Any) -> None:
    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = pb_grpc.ServingStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        try:
            for _ in stub.Generate(request, metadata=metadata, timeout=60):
                pass
        except grpc.RpcError as exc:
            assert exc.code() in CLEAN_CODES, (exc.code(), exc.details())


def test_cluster_still_serves_after_fuzzing(oai: openai.OpenAI, greedy_text: str) -> None:
    out = oai.completions.create(model="demo", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_text
