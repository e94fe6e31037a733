"""The grammar vocabulary of a model whose added tokens read as text: the demo reasoner's
`<think>` and `</think>` (ids 4096, 4097), and EOS's `<|endoftext|>`. A grammar's text comes in
ordinary tokens, even where it reads as an added token; the markers come only where a Lark
grammar names them as tokens."""

from __future__ import annotations

import re
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer

from replica.batch import FinishReason
from replica.engine import Engine, ProposerKind
from replica.grammar_vocab import grammar_tokenizer
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from tests.replica.engine_runs import run

EOS, THINK, END_THINK = 0, 4096, 4097
PROMPT_TEXT = "<|user|>Think first.<|assistant|>"
regex = llguidance.LLMatcher.grammar_from_regex
schema = llguidance.LLMatcher.grammar_from_json_schema
GRAMMARS = {
    "regex": (regex("<think>I should call."), "<think>I should call."),
    "lark": (
        llguidance.grammar_from("lark", 'start: "<think>" /[a-z ]{1,12}/ "</think>" "ok"'),
        "<think>[a-z ]{1,12}</think>ok",
    ),
    "const": (schema({"const": "</think>"}), re.escape('"</think>"')),
    "enum": (schema({"enum": ["<think>"]}), re.escape('"<think>"')),
    "pattern": (
        schema({"type": "string", "pattern": "^<think>[a-z]{1,8}$"}),
        '"<think>[a-z]{1,8}"',
    ),
    "eos text": (regex(r"<\|endoftext\|> done"), re.escape("<|endoftext|> done")),
}
"""Name: (a grammar forcing text an added token reads as, the regex its output matches)."""


@pytest.fixture(scope="module")
def tokenizer(reasoner_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(reasoner_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reasoner(reasoner_dir: Path) -> ModelRunner:
    return ModelRunner(reasoner_dir, num_blocks=64)


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer, reasoner: ModelRunner) -> llguidance.LLTokenizer:
    return grammar_tokenizer(tokenizer, reasoner.vocab_size, reasoner.config.eos_token_ids)


def constrained(
    engine: Engine, tokenizer: Tokenizer, grammar: str, ks: list[int]
) -> tuple[list[int], FinishReason | None]:
    prompt = tokenizer.encode(PROMPT_TEXT).ids
    params = SamplingParams(max_tokens=48, grammar=grammar)
    return run(engine, Request("q", prompt, params, tier=Tier.BEST_EFFORT), ks)


def test_added_tokens_stay_special_and_their_text_is_spelled_without_them(
    vocab: llguidance.LLTokenizer, tokenizer: Tokenizer
) -> None:
    """No text matches the markers or EOS; the text that reads as them tokenizes into
    ordinary tokens (the model's tokenizer gives the marker), which spell it."""
    assert tokenizer.encode("<think>").ids == [THINK]
    assert all(vocab.is_special_token(t) for t in (EOS, THINK, END_THINK))
    for text in ("<think>I should", "say </think>", "<|endoftext|>"):
        ids = vocab.tokenize_str(text)
        assert not any(vocab.is_special_token(t) for t in ids), text
        assert vocab.decode_str(ids) == text
    assert vocab.vocab_size == 4098 and vocab.eos_tokens == [EOS]


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_text_that_reads_as_an_added_token_follows_the_grammar(
    reasoner: ModelRunner,
    vocab: llguidance.LLTokenizer,
    tokenizer: Tokenizer,
    name: str,
    proposer: ProposerKind | None,
) -> None:
    """llguidance used to force such text as the added token, then refuse the token it had
    forced: the output aborted after it. It now ends complete, in ordinary tokens."""
    grammar, pattern = GRAMMARS[name]
    engine = Engine(reasoner, proposer=proposer, grammar_vocab=vocab)
    out, reason = constrained(engine, tokenizer, grammar, [3, 1] if proposer else [0])
    assert re.fullmatch(pattern, tokenizer.decode(out)), tokenizer.decode(out)
    assert reason is FinishReason.STOP
    assert not {EOS, THINK, END_THINK} & set(out)


def test_a_lark_grammar_names_the_markers_as_tokens(
    reasoner: ModelRunner, vocab: llguidance.LLTokenizer, tokenizer: Tokenizer
) -> None:
    """`<think>` unquoted is llguidance's syntax for the token itself: the model's own
    markers, as a thinking stage's end reads them."""
    lark = 'start: <think> /[a-z ]{1,12}/ </think> ("yes" | "no")'
    engine = Engine(reasoner, grammar_vocab=vocab)
    out, reason = constrained(engine, tokenizer, llguidance.grammar_from("lark", lark), [0])
    assert out[0] == THINK and out.count(END_THINK) == 1 and reason is FinishReason.STOP
    assert re.fullmatch("<think>[a-z ]{1,12}</think>(yes|no)", tokenizer.decode(out))
