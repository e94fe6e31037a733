"""What the HTTP door, the gRPC door and the Python SDK agree on about a request's shape:
a chat message's fields and content, an earlier tool call's, an SLO stage's, and the headers
that say where a request runs. Kept light (no tokenizer, no grammar engine), as the SDK
imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.errors import BadRequest

MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
ECHOED_MESSAGE_FIELDS = ("refusal", "annotations", "audio", "function_call", "parsed")
"""What the openai package's message objects hold besides, sent back with the conversation
and ignored (as vLLM ignores them)."""
REASONING_MESSAGE_FIELDS = ("reasoning_content", "reasoning")
"""An assistant's earlier thinking, as this server's and vLLM's responses give it (newer
vLLM names it `reasoning`): sent back with the conversation, it reaches the template."""
SENT_MESSAGE_FIELDS = (*MESSAGE_FIELDS, *REASONING_MESSAGE_FIELDS)
"""What a chat message may carry to the template."""
STAGE_FIELDS = ("tpot_ms", "num_tokens", "ttft_ms", "name", "end_token_ids", "until")
HEADER_VERDICT = "x-slos-serve-verdict"
HEADER_REPLICA = "x-slos-serve-replica"
HEADER_HOPS = "x-slos-serve-hops"


def tool_call_fields(call: object, where: str) -> tuple[str, str, str]:
    """An earlier call's id, function name and arguments (text, JSON as the server sends it),
    in OpenAI's shape."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if (
        not isinstance(call, Mapping)
        or set(call) - {"id", "type", "function", "index"}  # index: the SDK's stream helper
        or call.get("type", "function") != "function"
        or not isinstance(call.get("id", ""), str)
        or not isinstance(function, Mapping)
        or set(function) - {"parsed_arguments"} != {"name", "arguments"}
        or not isinstance(function["name"], str)
        or not isinstance(function["arguments"], str)
    ):
        raise BadRequest(
            f"{where} must be {{id, type: function, function: {{name, arguments}}}}", where
        )
    return call.get("id", ""), function["name"], function["arguments"]


def message_content(raw: object, where: str) -> str:
    """Message content: a string, or a list of text parts (OpenAI's multi-part form)."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        parts = []
        for j, part in enumerate(raw):
            ok = isinstance(part, dict) and part.get("type") == "text"
            if not ok or set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise BadRequest(f"{where}[{j}] must be {{type: text, text: <string>}}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def message_reasoning(m: Mapping[str, Any], where: str) -> str | None:
    """An assistant's earlier thinking, `reasoning_content` or `reasoning` (the first that
    is not null)."""
    texts = []
    for name in REASONING_MESSAGE_FIELDS:
        value = m.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRequest(f"{where}.{name} must be a string or null", f"{where}.{name}")
        if m.get("role") != "assistant":
            raise BadRequest(f"{where}: only assistant messages take {name}", where)
        texts.append(value)
    return texts[0] if texts else None
