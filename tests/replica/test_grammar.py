"""Structured output in the engine: the output follows its grammar and ends when the grammar is
complete; speculation and resumes leave it exactly as plain decoding gives it; constraints
that leave no token end the output instead of failing the step."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer

from cluster.migration import resumed_request
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine, ProposerKind
from replica.grammar import Grammar
from replica.grammar_vocab import grammar_tokenizer
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from replica.spec.draft import load_draft_vocab
from tests.replica.engine_runs import run

PROMPT_TEXT = "def add(a, b):\n    return a + b\n"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}
JSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(
    SCHEMA, {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
)


@pytest.fixture(scope="module")
def tokenizer(target_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(target_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer.encode(PROMPT_TEXT).ids)


@pytest.fixture(scope="module")
def runners(target_dir: Path, draft_dir: Path) -> dict[str, tuple[ModelRunner, ModelRunner]]:
    target = ModelRunner(target_dir, num_blocks=64)
    cut = ModelRunner(draft_dir, num_blocks=64, head_vocab=load_draft_vocab(draft_dir))
    return {"whole": (target, ModelRunner(draft_dir, num_blocks=64)), "cut": (target, cut)}


@pytest.fixture(scope="module")
def vocab(tokenizer: Tokenizer, runners: dict[str, tuple[ModelRunner, ModelRunner]]) -> object:
    target = runners["whole"][0]
    return grammar_tokenizer(tokenizer, target.vocab_size, target.config.eos_token_ids)


def engine(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    pair: str = "whole",
    proposer: ProposerKind | None = None,
) -> Engine:
    return Engine(*runners[pair], proposer=proposer, grammar_vocab=vocab)


def best_effort(prompt: list[int], **sampling: object) -> Request:
    params = SamplingParams(**{"max_tokens": 96, **sampling})  # type: ignore[arg-type]
    return Request("q", prompt, params, tier=Tier.BEST_EFFORT)


def test_masks_follow_the_proposal_and_leave_the_state_as_it_was(
    vocab: llguidance.LLTokenizer, tokenizer: Tokenizer
) -> None:
    """Row i is the mask after the first i proposed tokens; a refused token leaves the rows
    after it unmasked; the matcher is where it was after every call."""
    valid = tokenizer.encode('{"name": "ab", "size": 7').ids
    grammar = Grammar(vocab, JSON_GRAMMAR)
    rows = grammar.banned(valid, 0, len(valid) + 1)
    for i in range(len(valid) + 1):
        alone = Grammar(vocab, JSON_GRAMMAR, valid[:i])
        assert bool((alone.banned((), 0, 1)[0] == rows[i]).all()), i
        assert not bool(rows[i][valid[i]]) if i < len(valid) else True
    assert bool(grammar.banned(valid, 2, 1)[0].equal(rows[2]))
    refused = tokenizer.encode("x").ids[0]
    assert bool(rows[0][refused])
    broken = grammar.banned([valid[0], refused, valid[1]], 0, 4)
    assert bool(broken[1][refused]) and not bool(broken[2].any()) and not bool(broken[3].any())
    assert bool(grammar.banned((), 0, 1)[0].equal(rows[0]))
    assert not grammar.done


class MaskFailing:
    """A matcher whose `at`-th mask fails, as an llguidance error would."""

    def __init__(self, matcher: llguidance.LLMatcher, at: int) -> None:
        self.matcher, self.at, self.calls = matcher, at, 0

    def compute_logit_bias(self) -> bytes:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("a mask llguidance could not compute")
        return bytes(self.matcher.compute_logit_bias())

    def __getattr__(self, name: str) -> object:
        return getattr(self.matcher, name)


def test_a_mask_that_fails_midway_leaves_the_state_as_it_was(
    vocab: llguidance.LLTokenizer, tokenizer: Tokenizer
) -> None:
    """The engine goes on without drafts when masking them fails: the grammar must not have
    moved over the proposed tokens it had consumed."""
    valid = tokenizer.encode('{"name": "ab", "size": 7').ids
    grammar = Grammar(vocab, JSON_GRAMMAR)
    first = grammar.banned((), 0, 1)[0]
    real = grammar.matcher
    grammar.matcher = MaskFailing(real, at=3)  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="could not compute"):
        grammar.banned(valid, 0, 5)
    grammar.matcher = real
    assert bool(grammar.banned((), 0, 1)[0].equal(first))


def test_greedy_and_sampled_outputs_follow_the_schema_and_end_with_it(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    tokenizer: Tokenizer,
    prompt: list[int],
) -> None:
    for sampled in ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0}):
        out, reason = run(
            engine(runners, vocab), best_effort(prompt, grammar=JSON_GRAMMAR, **sampled), [0]
        )
        value = json.loads(tokenizer.decode(out))
        assert set(value) == {"name", "size", "tags"}, sampled
        assert isinstance(value["size"], int) and 0 <= value["size"] <= 999
        assert set(value["tags"]) <= {"a", "b"} and len(value["name"]) <= 12
        assert reason is FinishReason.STOP and tokenizer.decode(out).endswith("}")
    plain, _ = run(engine(runners, vocab), best_effort(prompt), [0])
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(plain))


@pytest.mark.parametrize("sampled", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_speculation_keeps_structured_output_exactly(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    prompt: list[int],
    sampled: dict[str, object],
) -> None:
    """Verify rows follow their proposals through the grammar, drafts propose inside it, and
    n-gram proposals it refuses are rejected: any k gives the plain output."""
    request = best_effort(prompt, grammar=JSON_GRAMMAR, **sampled)
    plain, _ = run(engine(runners, vocab), request, [0])
    cases: list[tuple[str, ProposerKind]] = [
        ("whole", "draft"),
        ("cut", "draft"),
        ("whole", "ngram"),
    ]
    for pair, proposer in cases:
        assert run(engine(runners, vocab, pair, proposer), request, [3, 1, 5])[0] == plain, (
            pair,
            proposer,
        )


def test_a_resumed_request_goes_on_inside_its_grammar(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    prompt: list[int],
) -> None:
    """The output a resume turned into prompt advances the grammar first; without that the
    continuation starts the grammar over."""
    original = best_effort(prompt, grammar=JSON_GRAMMAR)
    plain, _ = run(engine(runners, vocab), original, [0])
    resumed = resumed_request(original, plain[:6])
    assert run(engine(runners, vocab, proposer="draft"), resumed, [2])[0] == plain[6:]
    forgetful = Request("f", resumed.prompt_token_ids, resumed.sampling, tier=Tier.BEST_EFFORT)
    assert run(engine(runners, vocab), forgetful, [0])[0] != plain[6:]


def test_a_choice_ends_as_soon_as_it_is_complete(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    tokenizer: Tokenizer,
    prompt: list[int],
) -> None:
    grammar = llguidance.grammar_from("choice", json.dumps(["return a", "pass", "yield b"]))
    for seed in range(4):
        out, reason = run(
            engine(runners, vocab, proposer="draft"),
            best_effort(prompt, grammar=grammar, temperature=1.5, seed=seed, ignore_eos=True),
            [3],
        )
        assert tokenizer.decode(out) in ("return a", "pass", "yield b")
        assert reason is FinishReason.STOP


@pytest.mark.parametrize("sampled", [{}, {"temperature": 1.0}], ids=["greedy", "sampled"])
def test_constraints_that_leave_no_token_end_the_output(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    tokenizer: Tokenizer,
    prompt: list[int],
    sampled: dict[str, object],
) -> None:
    """allowed_token_ids that min_tokens holds back, or that the grammar refuses, leave a row
    with nothing in it: the row allows EOS alone (a sampled step used to fail on it), which
    ends the output; the grammar that refuses it ends as aborted."""
    eng = engine(runners, vocab, proposer="draft")
    eos = min(eng.eos_token_ids)
    held = best_effort(prompt, allowed_token_ids=(eos,), min_tokens=3, **sampled)
    assert run(eng, held, [2]) == ([eos], FinishReason.STOP)
    digit = tokenizer.encode("7").ids[0]
    refused = best_effort(prompt, grammar=JSON_GRAMMAR, allowed_token_ids=(digit,), **sampled)
    assert run(eng, refused, [2]) == ([eos], FinishReason.ABORT)


def test_a_grammar_that_cannot_go_on_ends_as_aborted(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    prompt: list[int],
) -> None:
    """llguidance's limits can stop a grammar the door found valid after a token or two: the
    output ends as aborted, not as a complete grammar's stop, saying why for its client."""
    grammar = llguidance.LLMatcher.grammar_from_regex("a{1000000}")
    assert llguidance.LLMatcher.validate_grammar(grammar, vocab) == ""
    eng = engine(runners, vocab)
    request = best_effort(prompt, grammar=grammar)
    eng.add_request(request)
    outcome = eng.step(BatchPlan((PrefillChunk("q", request.prompt_len),))).outcomes[0]
    while not outcome.finished:
        outcome = eng.step(BatchPlan((DecodeStep("q", 0),))).outcomes[0]
    assert outcome.finish_reason is FinishReason.ABORT and len(eng.output_token_ids("q")) < 4
    assert outcome.abort_reason.startswith("the output can no longer follow its grammar: ")


def test_grammars_are_refused_without_a_tokenizer_or_when_invalid(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    prompt: list[int],
) -> None:
    request = best_effort(prompt, grammar=JSON_GRAMMAR)
    with pytest.raises(ValueError, match="structured output needs a tokenizer"):
        Engine(*runners["whole"]).add_request(request)
    eng = engine(runners, vocab)
    bad = llguidance.LLMatcher.grammar_from_regex("a(b")
    with pytest.raises(ValueError, match=r"(?s)grammar: .*unclosed group"):
        eng.add_request(best_effort(prompt, grammar=bad))
    assert not eng.has_request("q")
    assert run(eng, request, [0])[1] is FinishReason.STOP


def test_a_model_llguidance_cannot_use_serves_plain_requests(
    target_dir: Path, prompt: list[int], tmp_path: Path
) -> None:
    """A model without EOS loads and serves as before; only structured output is refused."""
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(target_dir / name)
    config = json.loads((target_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    eng = Engine.from_dirs(tmp_path, num_blocks=16)
    assert eng.grammar_vocab is None and eng.detokenize is not None
    assert run(eng, best_effort(prompt, max_tokens=4), [0])[1] is FinishReason.LENGTH
    with pytest.raises(ValueError, match="tokenizer llguidance can use"):
        eng.add_request(best_effort(prompt, grammar=JSON_GRAMMAR))


def test_a_preempted_request_and_one_ignoring_eos_end_where_the_grammar_does(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    vocab: llguidance.LLTokenizer,
    prompt: list[int],
) -> None:
    """The matcher lives with the request, not its KV: a preemption mid-output recomputes the
    KV and goes on inside the grammar; a complete grammar ends the output even when EOS would
    not."""
    plain, reason = run(engine(runners, vocab), best_effort(prompt, grammar=JSON_GRAMMAR), [0])
    assert reason is FinishReason.STOP
    ignoring = best_effort(prompt, grammar=JSON_GRAMMAR, ignore_eos=True)
    assert run(engine(runners, vocab), ignoring, [0]) == (plain, FinishReason.STOP)
    eng = engine(runners, vocab, proposer="draft")
    eng.add_request(best_effort(prompt, grammar=JSON_GRAMMAR))
    eng.step(BatchPlan((PrefillChunk("q", len(prompt)),)))
    for _ in range(4):
        eng.step(BatchPlan((DecodeStep("q", 2),)))
    eng.preempt("q")
    known = len(prompt) + len(eng.output_token_ids("q"))
    eng.step(BatchPlan((PrefillChunk("q", known),)))
    while eng.finish_reason("q") is None:
        eng.step(BatchPlan((DecodeStep("q", 3),)))
    assert eng.output_token_ids("q") == plain
