"""Structured output at the door: the request fields that ask for it, compiled to the
llguidance grammar the replica follows (`SamplingParams.grammar`), and checked here, so a bad
schema or regex is a 400 naming its field rather than a failure on a replica.

Three spellings are taken, at most one per request:
- OpenAI's `response_format`: `{"type": "json_object"}` or
  `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`;
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or its text), `regex`,
  `choice` (a list of strings), `grammar` (Lark or GBNF), `json_object: true`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.

JSON comes out with fixed separators (", " and ": ") and no other whitespace: with any
whitespace allowed (vLLM's default), the demo model wrote newlines until max_tokens. A schema
may choose otherwise through llguidance's `x-guidance` options.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import llguidance

from replica.request import MAX_GRAMMAR_CHARS
from router import json_text
from router.errors import BadRequest, refuse_unknown
from router.tools import NAME

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stub alone

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""What `structured_outputs` may hold (vLLM's names); `guided_<kind>` are the older fields."""
GUIDED = tuple(f"guided_{kind}" for kind in KINDS if kind != "json_object")
MAX_CHOICE_STRINGS = 1024
FIELDS = ("response_format", "structured_outputs", *GUIDED)
"""The request fields that ask for structured output."""


def structured_grammar(
    body: Mapping[str, Any], vocab: Callable[[], llguidance.LLTokenizer]
) -> str | None:
    """The llguidance grammar a body's structured-output field asks for (None: plain text),
    checked against the model's vocabulary (`vocab`, only built when a body asks)."""
    asked = [name for name in FIELDS if body.get(name) is not None]
    if body.get("response_format") == {"type": "text"}:
        asked.remove("response_format")
    if len(asked) > 1:
        raise BadRequest(
            f"ask for structured output once; this request sets {' and '.join(asked)}", asked[1]
        )
    if not asked:
        return None
    name = asked[0]
    if name == "response_format":
        kind, value, where = _response_format(body[name])
    elif name == "structured_outputs":
        kind, value, where = _structured_outputs(body[name])
    else:
        kind, value, where = name.removeprefix("guided_"), body[name], name
    return _checked(_compile(kind, value, where), where, vocab)


def json_schema_grammar(
    schema: dict[str, Any], where: str, vocab: Callable[[], llguidance.LLTokenizer]
) -> str:
    """The checked grammar of a JSON schema the door made (tool calls), errors naming `where`."""
    return _checked(_compile("json", schema, where), where, vocab)


def _checked(grammar: str, where: str, vocab: Callable[[], llguidance.LLTokenizer]) -> str:
    """`grammar`, once it fits and llguidance takes it with the model's vocabulary."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise BadRequest(
            f"{where} is too long: {len(grammar)} characters as a grammar, at most "
            f"{MAX_GRAMMAR_CHARS}",
            where,
        )
    try:
        model_vocab = vocab()
    except ValueError as exc:
        raise BadRequest(
            f"{where}: this model's tokenizer cannot drive structured output ({exc})", where
        ) from exc
    # The matcher the replica will build, and its first mask: a grammar that compiles may
    # still allow nothing (a schema that is only a reference to itself), and the replica
    # would end its request empty.
    matcher = llguidance.LLMatcher(model_vocab, grammar, log_level=0)
    if matcher.is_error():
        raise BadRequest(f"{where}: {_trimmed(matcher.get_error())}", where)
    matcher.compute_logit_bias()
    if matcher.is_error():
        stuck = matcher.get_error().splitlines()[0]
        raise BadRequest(f"{where}: no output can begin to follow it ({_trimmed(stuck)})", where)
    return grammar


def _response_format(raw: object) -> tuple[str, object, str]:
    if not isinstance(raw, dict) or raw.get("type") not in ("json_object", "json_schema"):
        raise BadRequest(
            "response_format must be {type: text | json_object | json_schema}", "response_format"
        )
    kind = raw["type"]
    refuse_unknown(
        raw, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format"
    )
    if kind == "json_object":
        return "json_object", True, "response_format"
    spec = raw.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise BadRequest(f"{where} must be an object with a name and a schema", where)
    if not NAME.fullmatch(spec["name"]):
        raise BadRequest(f"{where}.name must be 1-64 letters, digits, _ or -", f"{where}.name")
    if not isinstance(spec.get("strict", False), bool):
        raise BadRequest(f"{where}.strict must be a boolean", f"{where}.strict")
    refuse_unknown(spec, ("name", "schema", "strict", "description"), where)
    if spec.get("schema") is None:
        raise BadRequest(f"{where}.schema is required", f"{where}.schema")
    return "json", spec["schema"], f"{where}.schema"


def _structured_outputs(raw: object) -> tuple[str, object, str]:
    if not isinstance(raw, dict):
        raise BadRequest("structured_outputs must be an object", "structured_outputs")
    refuse_unknown(raw, KINDS, "structured_outputs", f"; give one of {', '.join(KINDS)}")
    kinds = [k for k in KINDS if raw.get(k) is not None and raw.get(k) is not False]
    if len(kinds) != 1:
        raise BadRequest(
            f"structured_outputs must set exactly one of {', '.join(KINDS)}", "structured_outputs"
        )
    return kinds[0], raw[kinds[0]], f"structured_outputs.{kinds[0]}"


def _compile(kind: str, value: object, where: str) -> str:
    """The grammar text for one kind of structured output."""
    if isinstance(value, str) and len(value) > MAX_GRAMMAR_CHARS:
        raise BadRequest(f"{where} is longer than {MAX_GRAMMAR_CHARS} characters", where)
    if kind == "json_object":
        if value is not True:
            raise BadRequest(f"{where} must be true", where)
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if kind == "json":
        schema = _schema(value, where)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
        except ValueError as exc:  # values JSON cannot carry: huge numbers, lone surrogates
            raise BadRequest(f"{where}: {_trimmed(str(exc))}", where) from exc
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not 0 < len(value) <= MAX_CHOICE_STRINGS
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise BadRequest(
                f"{where} must be a list of 1..{MAX_CHOICE_STRINGS} non-empty strings", where
            )
        return llguidance.grammar_from("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where} must be a non-empty string", where)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise BadRequest(f"{where}: {_trimmed(str(exc))}", where) from exc


def _schema(value: object, where: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its text."""
    if isinstance(value, str):
        try:
            value = json_text.loads(value)
        except ValueError as exc:  # JSONDecodeError, NaN and Infinity
            raise BadRequest(f"{where} is not valid JSON: {exc}", where) from exc
        except RecursionError as exc:
            raise BadRequest(f"{where} is nested too deeply", where) from exc
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be a JSON schema object", where)
    return value


def _trimmed(message: str, most: int = 300) -> str:
    """llguidance's error (with the grammar line it points at), at a readable length."""
    return message.strip()[:most]
