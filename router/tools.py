"""Tool calls (OpenAI's `tools` and `tool_choice` on chat): forced by structured output, or read
out of free text ("auto").

A named function or `tool_choice: "required"` constrains the output to what a call needs, as
vLLM does without a model-specific parser: the named function's arguments (its `parameters`
schema), or a JSON array of one or more `{"name", "parameters"}` objects, one of the tools
each (one only with `parallel_tool_calls: false`). The door turns that text into the message's
`tool_calls`. `"auto"` leaves the output free and reads the calls out of it with the parser the
deployment names for its model family (`tool_call_parser`, router.tool_parsers); without one
it is refused, as vLLM refuses it unless started with one.

The tools go to the chat template, and so do the assistant's earlier calls (their arguments
as objects, as HF templates take them) and the tool messages answering them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from router import json_text
from router.errors import BadRequest, refuse_unknown
from router.tool_parsers import NAME, ToolParser, call_of

MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCalling:
    """How a chat request's output becomes tool calls."""

    schema: dict[str, Any] | None
    """What the output must be: the named function's arguments, or the array of calls; None
    for "auto" (the output is free)."""
    named: str | None
    """The function `tool_choice` names; None: "required" or "auto"."""
    where: str = "tools"
    """The field a bad schema is blamed on."""
    parser: ToolParser | None = None
    """"auto": how the model writes its calls among its text."""
    one_call: bool = False
    """"auto" with `parallel_tool_calls: false`: the first call only (as vLLM keeps it)."""
    parts: tuple[tuple[str, dict[str, Any]], ...] = ()
    """"required": each tool's arguments schema and its field, to blame the one that makes
    the whole schema fail."""

    @property
    def held_to_end(self) -> bool:
        """Its calls are known only once the output is whole ("required", "auto"); a named
        function's arguments are the output itself, sent as they come."""
        return self.named is None

    def finish_reason(self, reason: str | None) -> str | None:
        """The finish reason of an output that made calls: "required"'s, made whole, and
        "auto"'s whatever ended the output (as vLLM reports them: a last call may lack its
        closing tag) end with OpenAI's "tool_calls"; a named function's call ends as it did
        ("stop", as OpenAI and vLLM report a forced call)."""
        if self.parser is not None or (self.named is None and reason == "stop"):
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """The content and calls of an output that made calls, or None when it made none
        (plain text, or cut short)."""
        if self.parser is not None:
            parsed = self.parser.parse(text)
            if parsed is None:
                return None
            written = parsed.calls[:1] if self.one_call else parsed.calls
            return parsed.content, [_call(name, arguments) for name, arguments in written]
        calls = self.calls(text)
        return None if calls is None else (None, calls)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The calls an output holds, in OpenAI's form (fresh ids): a named function's call
        with the text as its arguments, whole or not; "required"'s array parsed (its arguments
        written again, as vLLM does), or None when the text is not one (cut short)."""
        if self.named is not None:
            return [self.named_call(text)]
        try:
            made = json_text.loads(text)
            decoded = [call_of(c, "parameters") for c in made] if isinstance(made, list) else [None]
        except ValueError:  # not JSON, or a number JSON cannot write back (1e999)
            return None
        calls = [_call(*c) for c in decoded if c is not None]
        return calls if len(calls) == len(decoded) else None

    def named_call(self, arguments: str) -> dict[str, Any]:
        """The named function's call with these arguments (a fresh id)."""
        assert self.named is not None
        return _call(self.named, arguments)


@dataclass
class ToolOutput:
    """One choice's output as it streams under tool calling: the message content that may go
    out so far ("auto": the text its parser rules out as a call), then the calls once whole.
    Both doors stream through it, so they agree on what is content."""

    tools: ToolCalling
    text: str = ""
    sent: int = 0
    """How much of `text` went out as content."""

    def content(self, text: str) -> str:
        """Add the output's next text; the content it lets go out now ("" for none)."""
        self.text += text
        parser = self.tools.parser
        if parser is None or not text:
            return ""
        end = parser.content_end(self.text, self.sent)
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent : end], end
        return piece

    def finish(self, reason: str | None) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        """The content not sent yet (the whole rest of an output that made no calls), the
        calls made (None: none), and the finish reason to report."""
        made = self.tools.message(self.text)
        if made is None:
            return self.text[self.sent :], None, reason
        return (made[0] or "")[self.sent :], made[1], self.tools.finish_reason(reason)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_calling(
    body: dict[str, Any], parser: ToolParser | None = None
) -> tuple[ToolCalling | None, list[dict[str, Any]]]:
    """What the body's `tool_choice` asks of the output (None: plain text), and its tools as
    the chat template gets them; `parser`: the deployment's, which "auto" needs."""
    tools = tools_of(body.get("tools"))
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None, []
    if choice == "none":
        return None, tools
    one_call = body.get("parallel_tool_calls") is False
    if choice in (None, "auto"):
        if parser is None:
            raise BadRequest(
                'tool_choice "auto" (the default with tools) needs a parser for how this '
                "model writes tool calls, which this deployment does not name "
                '(tool_call_parser); send "required", a named function or "none"',
                "tool_choice",
            )
        return ToolCalling(None, None, parser=parser, one_call=one_call), tools
    functions = [t["function"] for t in tools]
    parts = tuple(
        (f"tools[{i}].function.parameters", _parameters(f)) for i, f in enumerate(functions)
    )
    if choice == "required":
        schema = _calls_schema([f["name"] for f in functions], parts, one_call)
        return ToolCalling(schema, None, parts=parts), tools
    name = _named(choice)
    index = next((i for i, f in enumerate(functions) if f["name"] == name), None)
    if index is None:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    where, arguments = parts[index]
    return ToolCalling(arguments, name, where), tools


def _function_of(value: object) -> dict[str, Any] | None:
    """The function of `{"type": "function", "function": {...}}` (OpenAI's shape for a tool
    and a named tool_choice alike), or None for anything else."""
    if not isinstance(value, dict) or set(value) != {"type", "function"}:
        return None
    function = value["function"]
    return function if value["type"] == "function" and isinstance(function, dict) else None


def _named(choice: object) -> str:
    function = _function_of(choice)
    if function is None or set(function) != {"name"} or not isinstance(function["name"], str):
        raise BadRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return str(function["name"])


def tools_of(raw: object) -> list[dict[str, Any]]:
    """A body's `tools`, checked (OpenAI's function tools; none: an empty list)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    names: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        function = _function_of(tool)
        if function is None:
            raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        refuse_unknown(function, _FUNCTION_FIELDS, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest(
                f"{where}.function.name must be 1-64 letters, digits, _ or -",
                f"{where}.function.name",
            )
        if name in names:
            raise BadRequest(
                f"{where}.function.name: two tools are named {name!r}", f"{where}.function.name"
            )
        names.add(name)
        for field, kind, default in (("description", str, ""), ("strict", bool, False)):
            if not isinstance(function.get(field, default), kind):
                article = "a string" if kind is str else "a boolean"
                raise BadRequest(
                    f"{where}.function.{field} must be {article}", f"{where}.function.{field}"
                )
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise BadRequest(
                f"{where}.function.parameters must be a JSON schema of an object",
                f"{where}.function.parameters",
            )
    return raw


_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema (OpenAI: none given means no arguments)."""
    params = function.get("parameters")
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return params if "type" in params else {**params, "type": "object"}


def _calls_schema(
    names: list[str], parts: tuple[tuple[str, dict[str, Any]], ...], one_call: bool
) -> dict[str, Any]:
    """A JSON array of calls, each naming one of the functions with its arguments (`parts`:
    each one's arguments schema and its field). The functions' `$defs` and `definitions` move
    to the array's root, where their references point now that each schema sits inside the
    array (one name defined two ways is refused, and so is a reference to anything else of
    the schema, which no longer holds)."""
    shared: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    calls = []
    for function, (where, whole) in zip(names, parts, strict=True):
        params = dict(whole)
        for key, defs in shared.items():
            found = params.pop(key, {})
            if not isinstance(found, dict):
                raise BadRequest(f"{where}.{key} must be an object", where)
            for name, definition in found.items():
                if defs.setdefault(name, definition) != definition:
                    raise BadRequest(
                        f"{where} defines {key}/{name} unlike another tool; "
                        'tool_choice "required" puts every tool\'s definitions together',
                        where,
                    )
        try:
            outside = next((r for r in _refs(whole) if not r.startswith(_LIFTED)), None)
        except RecursionError:
            raise BadRequest(f"{where} is nested too deeply", where) from None
        if outside is not None:
            raise BadRequest(
                f'{where} refers to {outside!r}, which tool_choice "required" cannot keep '
                "(only #/$defs/ and #/definitions/ references); name the function instead",
                where,
            )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": function}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    schema |= {key: defs for key, defs in shared.items() if defs}
    if one_call:
        schema["maxItems"] = 1
    return schema


_LIFTED = ("#/$defs/", "#/definitions/")


def _refs(schema: object) -> list[str]:
    """Every `$ref` in a schema, its definitions' included."""
    if isinstance(schema, list):
        return [r for item in schema for r in _refs(item)]
    if not isinstance(schema, dict):
        return []
    own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
    return own + [r for key, value in schema.items() if key != "$ref" for r in _refs(value)]
