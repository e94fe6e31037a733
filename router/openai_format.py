"""OpenAI response shapes: full responses, stream chunks, SSE framing, the error JSON.

Every response also carries `slos_serve`: what the cluster did with the request (verdict,
replica, hops, SLO attainment per stage), since OpenAI's schema has no place for it.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.api import FinalRecord, Placement, Verdict
from router.errors import ApiError
from router.openai_schema import Endpoint

SSE_DONE = b"data: [DONE]\n\n"
HEADER_VERDICT = "x-slos-serve-verdict"
HEADER_REPLICA = "x-slos-serve-replica"
HEADER_HOPS = "x-slos-serve-hops"


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


def service_tier(record: FinalRecord) -> str:
    return "flex" if record.verdict is Verdict.BEST_EFFORT else "default"


def cluster_info(record: FinalRecord) -> dict[str, Any]:
    return {
        "verdict": record.verdict.value,
        "replica": record.replica,
        "hops": record.hops,
        "migrations": record.migrations,
        "slo_attained": record.slo_attained,
        "stages": [
            {"name": s.name, "attained": s.attained, "late_tokens": s.late_tokens}
            for s in record.stages
        ],
    }


def placement_headers(placement: Placement | None) -> dict[str, str]:
    """Where the request was bound: HTTP headers of a stream (sent with the first token) and
    gRPC initial metadata, so a client that stops reading early still learns the verdict."""
    if placement is None:
        return {}
    return {
        HEADER_VERDICT: placement.verdict.value,
        HEADER_REPLICA: str(placement.replica),
        HEADER_HOPS: str(placement.hops),
    }


def cluster_headers(record: FinalRecord) -> dict[str, str]:
    """Response headers for a finished (non-streamed) request."""
    headers = {HEADER_VERDICT: record.verdict.value, HEADER_HOPS: str(record.hops)}
    if record.replica is not None:
        headers[HEADER_REPLICA] = str(record.replica)
    if record.slo_attained is not None:
        headers["x-slos-serve-slo-attained"] = str(record.slo_attained).lower()
    return headers


def usage(record: FinalRecord) -> dict[str, int]:
    return {
        "prompt_tokens": record.num_prompt_tokens,
        "completion_tokens": record.num_output_tokens,
        "total_tokens": record.num_prompt_tokens + record.num_output_tokens,
    }


def full_response(
    endpoint: Endpoint, response_id: str, created: int, model: str, text: str, record: FinalRecord
) -> dict[str, Any]:
    """The non-streamed body of a finished request."""
    if endpoint is Endpoint.CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": record.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": record.finish_reason}
        obj = "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(record),
        "service_tier": service_tier(record),
        "slos_serve": cluster_info(record),
    }


class ChunkWriter:
    """Builds the SSE events of one streamed response, in OpenAI's chunk format."""

    def __init__(self, endpoint: Endpoint, response_id: str, created: int, model: str) -> None:
        self.endpoint = endpoint
        self.response_id = response_id
        self.created = created
        self.model = model
        self.role_sent = False

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

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.endpoint is Endpoint.COMPLETIONS:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"content": text}
        if not self.role_sent:
            delta["role"] = "assistant"
            self.role_sent = True
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def text(self, text: str) -> bytes:
        return self._chunk([self._choice(text, None)])

    def finish(self, record: FinalRecord, include_usage: bool) -> bytes:
        """The closing events: finish reason and cluster info, then usage, then [DONE]."""
        events = self._chunk(
            [self._choice("", record.finish_reason)],
            service_tier=service_tier(record),
            slos_serve=cluster_info(record),
        )
        if include_usage:
            events += self._chunk([], usage=usage(record))
        return events + SSE_DONE

    def error(self, error: ApiError) -> bytes:
        """An error after the stream started (status already sent): an error event, then [DONE]."""
        return sse_event(error_body(error)) + SSE_DONE
