"""Structured output at the door: each spelling a client may use becomes the grammar the
replica follows, and every bad one is a 400 naming its field."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import llguidance
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from replica.request import MAX_GRAMMAR_CHARS, SLO
from router.errors import BadRequest
from router.openai_schema import Endpoint, SchemaContext, parse_body
from router.structured import JSON_OPTIONS
from router.tokenizer import TextCodec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, JSON_OPTIONS)


@pytest.fixture(scope="module")
def ctx() -> SchemaContext:
    return SchemaContext("demo", 2048, 4096, SLO(ttft_ms=2000, tpot_ms=200))


def grammar(
    codec: TextCodec, ctx: SchemaContext, endpoint: Endpoint = Endpoint.COMPLETIONS, **fields: Any
) -> str | None:
    base: dict[str, Any] = (
        {"prompt": "x"}
        if endpoint is Endpoint.COMPLETIONS
        else {"messages": [{"role": "user", "content": "x"}]}
    )
    parsed = parse_body(endpoint, base | fields, {}, ctx, codec, request_id="r", arrival_time=0.0)
    grammars = {r.sampling.grammar for r in parsed.requests}
    assert len(grammars) == 1
    return grammars.pop()


def matches(codec: TextCodec, grammar_text: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and is complete after it."""
    matcher = llguidance.LLMatcher(codec.grammar_vocab, grammar_text, log_level=0)
    return bool(matcher.consume_tokens(codec.encode(text)) and matcher.is_accepting())


def test_every_spelling_of_a_json_schema_asks_for_the_same_grammar(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    spellings: list[dict[str, Any]] = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
    ]
    for fields in spellings:
        for endpoint in Endpoint:
            assert grammar(codec, ctx, endpoint, **fields) == JSON_GRAMMAR, fields
    assert matches(codec, JSON_GRAMMAR, '{"a": 12}')
    assert not matches(codec, JSON_GRAMMAR, '{"a":12}')  # fixed separators, no other space
    assert not matches(codec, JSON_GRAMMAR, '{"a": "12"}')


def test_plain_text_asks_for_nothing_and_leaves_another_field_alone(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    assert grammar(codec, ctx) is None
    assert grammar(codec, ctx, Endpoint.CHAT, response_format={"type": "text"}) is None
    alone = grammar(codec, ctx, structured_outputs={"json_object": True})
    with_text = {"structured_outputs": {"json_object": True}, "response_format": {"type": "text"}}
    assert alone is not None and grammar(codec, ctx, **with_text) == alone


def test_json_object_regex_choice_and_grammars(codec: TextCodec, ctx: SchemaContext) -> None:
    objects = [
        grammar(codec, ctx, Endpoint.CHAT, response_format={"type": "json_object"}),
        grammar(codec, ctx, structured_outputs={"json_object": True}),
    ]
    assert objects[0] == objects[1] and objects[0] is not None
    assert matches(codec, objects[0], '{"k": [1, 2]}') and not matches(codec, objects[0], "[1]")
    regex = grammar(codec, ctx, structured_outputs={"regex": r"\d{3}-[a-z]+"})
    assert regex == grammar(codec, ctx, guided_regex=r"\d{3}-[a-z]+") and regex is not None
    assert matches(codec, regex, "123-abc") and not matches(codec, regex, "12-abc")
    choice = grammar(codec, ctx, structured_outputs={"choice": ["yes", "no way"]})
    assert choice == grammar(codec, ctx, guided_choice=["yes", "no way"]) and choice is not None
    assert matches(codec, choice, "no way") and not matches(codec, choice, "maybe")
    lark = 'start: "x" NUM\nNUM: /[0-9]+/'
    gbnf = 'root ::= "x" [0-9]+'
    for text in (lark, gbnf):
        made = grammar(codec, ctx, structured_outputs={"grammar": text})
        assert made == grammar(codec, ctx, guided_grammar=text) and made is not None
        assert matches(codec, made, "x42") and not matches(codec, made, "y42"), text


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "type: text"),
        ({"response_format": {"type": "json_object", "x": 1}}, "response_format.x", "x is not"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 3}}},
            "response_format.json_schema.schema",
            "schema object",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a b", "schema": {}},
                }
            },
            "response_format.json_schema.name",
            "name must be",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {}, "strict": "yes"},
                }
            },
            "response_format.json_schema.strict",
            "strict must be a boolean",
        ),
        ({"structured_outputs": []}, "structured_outputs", "an object"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"regex": "a", "json_object": 0}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"regex": 0}}, "structured_outputs.regex", "non-empty string"),
        ({"guided_json": '{"const": NaN}'}, "guided_json", "not valid JSON"),
        (
            {"structured_outputs": {"structural_tag": "a"}},
            "structured_outputs.structural_tag",
            "structural_tag",
        ),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not valid JSON"),
        (
            {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
            "structured_outputs.json",
            "Unsatisfiable schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"guided_json": {"$ref": "#"}}, "guided_json", "no output can begin to follow it"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"$ref": "#"}},
                }
            },
            "response_format.json_schema.schema",
            "no output can begin",
        ),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"guided_choice": []}, "guided_choice", "list of 1.."),
        ({"guided_choice": ["a", 3]}, "guided_choice", "list of 1.."),
        ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "from GBNF to Lark"),
        ({"guided_json": {"properties": {"a": {"type": "foo"}}}}, "guided_json", "Invalid type"),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "once"),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "guided_choice",
            "once",
        ),
        ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex", "longer than"),
        ({"guided_json": "[" * 60000}, "guided_json", "nested too deeply"),
        (
            {"guided_json": {"type": "integer", "minimum": 10**400}},
            "guided_json",
            "not JSON serializable",
        ),
        ({"guided_json": '{"enum": ["\\ud800"]}'}, "guided_json", "not JSON serializable"),
        ({"structured_outputs": {"type": "text"}}, "structured_outputs.type", "type is not"),
    ],
)
def test_bad_structured_outputs_are_named(
    codec: TextCodec, ctx: SchemaContext, fields: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(BadRequest, match=message) as info:
        grammar(codec, ctx, **fields)
    assert info.value.param == param


def test_a_model_without_eos_is_refused_at_the_door_as_its_replicas_would(
    codec: TextCodec, ctx: SchemaContext
) -> None:
    """The door builds the grammar vocabulary from the model's config, as a replica does: a
    model naming no EOS cannot drive structured output there, so the door says so."""
    assert codec.eos_token_ids == (0,) and codec.model_vocab_size == 4096
    no_eos = replace(codec, eos_token_ids=())
    assert grammar(no_eos, ctx) is None
    with pytest.raises(BadRequest, match="cannot drive structured output") as info:
        grammar(no_eos, ctx, guided_regex="x+")
    assert info.value.param == "guided_regex"


def test_plain_requests_never_build_the_grammar_vocabulary(ctx: SchemaContext) -> None:
    """A tokenizer llguidance cannot read (WordPiece) costs plain requests nothing; a
    structured one is a 400 saying so."""
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "x": 2}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    codec = TextCodec(wordpiece)
    assert grammar(codec, ctx) is None
    with pytest.raises(BadRequest, match="cannot drive structured output") as info:
        grammar(codec, ctx, guided_regex="x+")
    assert info.value.param == "guided_regex"
