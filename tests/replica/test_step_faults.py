"""A fault in one request's own part of a step (its sampling, its drafts) stays its own: the
requests batched with it get the tokens they get without it. The fault is injected into the
real engine by wrapping `token_probs` so that it raises for one request's temperature, as a
bug reached by one request's parameters would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import replica.engine
import replica.spec.draft
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine, StepFailed
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from replica.sampling import token_probs

CULPRIT_TEMPERATURE = 0.77
MAX_TOKENS = 8
PROMPTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "import torch\n"]
K = 3


@pytest.fixture(scope="module")
def prompts(target_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in PROMPTS]


def _failing_for_the_culprit(module: object, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """`module`'s token_probs raises at its `at`-th call for the culprit, once."""
    calls = 0

    def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        nonlocal calls
        if params.temperature == CULPRIT_TEMPERATURE:
            calls += 1
            if calls == at:
                raise RuntimeError("a sampling bug this request's parameters reach")
        return token_probs(logits, params)

    monkeypatch.setattr(module, "token_probs", probs)


def _requests(prompts: list[list[int]], culprit: float) -> list[Request]:
    """A greedy request, a seeded sampled one, and a seeded one at `culprit`'s temperature."""
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=culprit, seed=5, ignore_eos=True),
    ]
    return [
        Request(f"r{i}", p, s, tier=Tier.BEST_EFFORT)
        for i, (p, s) in enumerate(zip(prompts, params, strict=True))
    ]


def _batched(
    engine: Engine, requests: list[Request], k: int, each_step: Callable[[Engine], None]
) -> tuple[dict[str, list[int]], dict[str, FinishReason | None], list[int]]:
    """Prefill all in one step, decode all together at `k` until each ends; the outputs,
    finish reasons, and the drafts each decode step verified."""
    for r in requests:
        engine.add_request(r)
    outcome = engine.step(
        BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in requests))
    )
    each_step(engine)
    reasons = {o.request_id: o.finish_reason for o in outcome.outcomes}
    outputs = {o.request_id: list(o.new_token_ids) for o in outcome.outcomes}
    drafts = []
    while live := [r.request_id for r in requests if reasons[r.request_id] is None]:
        outcome = engine.step(BatchPlan(tuple(DecodeStep(rid, k) for rid in live)))
        each_step(engine)
        drafts.append(sum(o.num_draft_tokens for o in outcome.outcomes))
        for o in outcome.outcomes:
            outputs[o.request_id] += o.new_token_ids
            reasons[o.request_id] = o.finish_reason
    return outputs, reasons, drafts


def _nothing(engine: Engine) -> None:
    pass


def _reference(
    runners: tuple[ModelRunner, ModelRunner], prompts: list[list[int]]
) -> dict[str, list[int]]:
    """Every request's output with no fault anywhere and no speculation (the culprit at a
    temperature that reaches no bug)."""
    engine = Engine(*runners, proposer="draft")
    outputs, _, _ = _batched(engine, _requests(prompts, CULPRIT_TEMPERATURE), 0, _nothing)
    return outputs


@pytest.mark.parametrize("at", [1, 2], ids=["at-its-prefill", "at-its-first-verify"])
def test_a_request_whose_sampling_fails_ends_alone(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    at: int,
) -> None:
    """The culprit fails as its prompt's first token is sampled, or as its first drafts are
    verified (the others' drafts in flight beside it): it ends with no KV left in either
    cache from that step on, its tokens before the fault kept, and the others' outputs are
    theirs."""
    reference = _reference(runners, prompts)
    _failing_for_the_culprit(replica.engine, monkeypatch, at=at)
    engine = Engine(*runners, proposer="draft")

    def culprit_freed_once_ended(engine: Engine) -> None:
        assert engine.draft is not None
        if engine.finish_reason("r2") is not None:
            assert engine.cache.num_tokens("r2") == engine.draft.cache.num_tokens("r2") == 0

    outputs, reasons, _ = _batched(
        engine, _requests(prompts, CULPRIT_TEMPERATURE), K, culprit_freed_once_ended
    )
    assert reasons == {
        "r0": FinishReason.LENGTH,
        "r1": FinishReason.LENGTH,
        "r2": FinishReason.ABORT,
    }
    assert outputs["r2"] == reference["r2"][: at - 1]
    assert outputs["r0"] == reference["r0"] and outputs["r1"] == reference["r1"]
    for rid in reasons:
        engine.abort(rid)
    assert engine.num_free_blocks == engine.cache.num_blocks
    assert engine.draft is not None
    assert engine.draft.cache.num_free_blocks == engine.draft.cache.num_blocks


def test_a_request_whose_drafting_fails_leaves_its_step_without_drafts(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The culprit's bug is in the draft's sampling only, once, at its second draft token,
    when the others have drafted one token ahead of what the target verifies: every request
    still gets its own output (seeded and greedy outputs do not depend on drafts), that step
    verifies none, the draft keeps nothing past what the target verified, and the next steps
    draft again."""
    reference = _reference(runners, prompts)
    _failing_for_the_culprit(replica.spec.draft, monkeypatch, at=2)
    engine = Engine(*runners, proposer="draft")

    def draft_within_target(engine: Engine) -> None:
        assert engine.draft is not None
        for rid in ("r0", "r1", "r2"):
            if engine.has_request(rid) and engine.finish_reason(rid) is None:
                drafted = engine.draft.cache.num_tokens(rid)
                assert drafted <= engine.num_computed_tokens(rid)

    outputs, reasons, drafts = _batched(
        engine, _requests(prompts, CULPRIT_TEMPERATURE), K, draft_within_target
    )
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert outputs == reference
    assert drafts[0] == 0 and sum(drafts[1:]) > 0


def test_a_value_error_once_the_step_runs_is_not_a_refusal(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica takes a ValueError from a step for "refused, nothing changed" and waits for
    the next plan; one from the forward pass comes after KV was reserved, so it must fail the
    step instead."""
    engine = Engine(*runners, proposer="draft")
    request = _requests(prompts, CULPRIT_TEMPERATURE)[0]
    engine.add_request(request)

    def forward(seqs: object) -> torch.Tensor:
        raise ValueError("a shape the kernels do not take")

    monkeypatch.setattr(runners[0], "forward", forward)
    with pytest.raises(StepFailed, match="after it began: a shape") as info:
        engine.step(BatchPlan((PrefillChunk(request.request_id, request.prompt_len),)))
    assert not isinstance(info.value, ValueError)
    engine.abort(request.request_id)
