"""Bias, penalties, min_tokens and stop token ids in the engine: speculation and resumes leave
the output exactly as plain decoding gives it, and stop conditions wait for min_tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.migration import resumed_request
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine, ProposerKind, load_detokenizer
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from replica.spec.draft import load_draft_vocab

MAX_TOKENS = 24
PROMPT_TEXT = "def add(a, b):\n    return a + b\n"
SHAPINGS = {
    "frequency": {"frequency_penalty": 1.5},
    "presence+repetition": {"presence_penalty": 1.0, "repetition_penalty": 1.3},
    "bias": {"logit_bias": ((67, -100.0), (92, 4.0))},  # "_" never, "x" more often
    "min_tokens": {"min_tokens": 12, "stop_token_ids": (203,)},  # no "\\n" before 12 tokens
}


@pytest.fixture(scope="module")
def prompt(target_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode(PROMPT_TEXT).ids


@pytest.fixture(scope="module")
def runners(target_dir: Path, draft_dir: Path) -> dict[str, tuple[ModelRunner, ModelRunner]]:
    target = ModelRunner(target_dir, num_blocks=64)
    cut = ModelRunner(draft_dir, num_blocks=64, head_vocab=load_draft_vocab(draft_dir))
    return {"whole": (target, ModelRunner(draft_dir, num_blocks=64)), "cut": (target, cut)}


def run(engine: Engine, request: Request, ks: list[int]) -> tuple[list[int], FinishReason | None]:
    rid = request.request_id
    engine.add_request(request)
    engine.step(BatchPlan((PrefillChunk(rid, request.prompt_len),)))
    step = 0
    while engine.finish_reason(rid) is None:
        engine.step(BatchPlan((DecodeStep(rid, ks[step % len(ks)]),)))
        step += 1
    out, reason = engine.output_token_ids(rid), engine.finish_reason(rid)
    engine.abort(rid)
    assert engine.num_free_blocks == engine.cache.num_blocks
    return out, reason


def best_effort(prompt: list[int], **sampling: object) -> Request:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, **sampling})  # type: ignore[arg-type]
    return Request("q", prompt, params, tier=Tier.BEST_EFFORT)


@pytest.mark.parametrize("shaping", SHAPINGS)
@pytest.mark.parametrize("sampled", [{}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_speculation_keeps_shaped_output_exactly(
    runners: dict[str, tuple[ModelRunner, ModelRunner]],
    prompt: list[int],
    shaping: str,
    sampled: dict[str, object],
) -> None:
    """Each verify row is shaped as if its proposal had been decoded one by one, so drafts
    (whole or cut head) and n-grams at any k give the plain output."""
    request = best_effort(prompt, **SHAPINGS[shaping], **sampled)
    plain, _ = run(Engine(*runners["whole"]), request, [0])
    unshaped, _ = run(Engine(*runners["whole"]), best_effort(prompt, **sampled), [0])
    assert plain != unshaped
    cases: list[tuple[str, ProposerKind]] = [
        ("whole", "draft"),
        ("cut", "draft"),
        ("whole", "ngram"),
    ]
    for pair, proposer in cases:
        engine = Engine(*runners[pair], proposer=proposer)
        assert run(engine, request, [3, 1, 5])[0] == plain, (pair, proposer)


def test_a_resumed_request_is_shaped_as_where_it_began(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    """Penalties count the output a resume turned into prompt; min_tokens counts what is
    left. Without that accounting the resumed output differs."""
    engine = Engine(*runners["whole"], proposer="draft")
    original = best_effort(prompt, frequency_penalty=1.5, presence_penalty=0.5, min_tokens=12)
    plain, _ = run(engine, original, [0])
    resumed = resumed_request(original, plain[:8])
    assert run(engine, resumed, [2])[0] == plain[8:]
    forgetful = Request("f", resumed.prompt_token_ids, resumed.sampling, tier=Tier.BEST_EFFORT)
    assert run(engine, forgetful, [2])[0] != plain[8:]


def test_min_tokens_holds_back_eos_then_lets_it_end_the_output(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    engine = Engine(*runners["whole"], proposer="draft")
    eos = next(iter(engine.eos_token_ids))
    forced = {"logit_bias": ((eos, 100.0),), "max_tokens": 10}
    assert run(engine, best_effort(prompt, **forced), [3]) == ([eos], FinishReason.STOP)
    out, reason = run(engine, best_effort(prompt, **forced, min_tokens=6), [3])
    assert len(out) == 7 and out[-1] == eos and eos not in out[:-1]
    assert reason is FinishReason.STOP
    ignored, reason = run(engine, best_effort(prompt, **forced, ignore_eos=True), [3])
    assert ignored == [eos] * 10 and reason is FinishReason.LENGTH


def test_a_stop_token_id_ends_the_output_once_min_tokens_are_out(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int]
) -> None:
    engine = Engine(*runners["whole"], proposer="draft")
    plain, _ = run(engine, best_effort(prompt, ignore_eos=True), [0])
    stop_id = plain[4]
    first = plain.index(stop_id)
    out, reason = run(engine, best_effort(prompt, stop_token_ids=(stop_id,)), [3])
    assert (out, reason) == (plain[: first + 1], FinishReason.STOP)
    held, _ = run(engine, best_effort(prompt, stop_token_ids=(stop_id,), min_tokens=8), [3])
    assert len(held) >= 8 and stop_id not in held[:8]


def test_stop_strings_wait_for_min_tokens(
    runners: dict[str, tuple[ModelRunner, ModelRunner]], prompt: list[int], target_dir: Path
) -> None:
    """A stop string ending in the first min_tokens - 1 tokens' text does not count; the
    first one ending later does, even with the earlier one still in the decoded window."""
    detok = load_detokenizer(target_dir)
    assert detok is not None
    engine = Engine(*runners["whole"], proposer="draft", detokenize=detok)
    plain, _ = run(engine, best_effort(prompt, ignore_eos=True), [0])
    stop = "_"
    ends = [
        n
        for n in range(1, len(plain) + 1)
        if detok(plain[:n]).count(stop) > detok(plain[: n - 1]).count(stop)
    ]
    assert len(ends) >= 2, detok(plain)
    for min_tokens, want in ((0, ends[0]), (ends[0] + 1, ends[1])):
        request = best_effort(prompt, stop=(stop,), min_tokens=min_tokens, ignore_eos=True)
        assert run(engine, request, [3]) == (plain[:want], FinishReason.STOP), min_tokens
