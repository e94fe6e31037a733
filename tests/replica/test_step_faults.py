"""A fault in one request's own part of a step (its sampling, its drafts, its forward) stays
its own: the requests batched with it get the tokens they get without it. Faults are injected
into the real engine by wrapping `token_probs` so that it raises for one request's temperature,
as a bug reached by one request's parameters would, or the runners' `forward`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import replica.engine
import replica.spec.draft
from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine, StepFailed
from replica.model_runner import ForwardSeq, ModelRunner
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


def _check_culprit_ended_alone(
    engine: Engine,
    outputs: dict[str, list[int]],
    reasons: dict[str, FinishReason | None],
    reference: dict[str, list[int]],
    at: int,
) -> None:
    """The culprit ended aborted with the tokens of the steps before its fault at step
    `at`, the others with their own outputs; once all are released, no KV is held."""
    assert reasons == {
        "r0": FinishReason.LENGTH,
        "r1": FinishReason.LENGTH,
        "r2": FinishReason.ABORT,
    }
    assert outputs["r2"] == reference["r2"][: at - 1]
    assert outputs["r0"] == reference["r0"] and outputs["r1"] == reference["r1"]
    _release_all(engine, list(reasons))


def _release_all(engine: Engine, request_ids: list[str]) -> None:
    """Release the requests: both caches must then be wholly free."""
    for rid in request_ids:
        engine.abort(rid)
    assert engine.num_free_blocks == engine.cache.num_blocks
    assert engine.draft is not None
    assert engine.draft.cache.num_free_blocks == engine.draft.cache.num_blocks


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
    _check_culprit_ended_alone(engine, outputs, reasons, reference, at)


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


def _failing_forward(
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    fails: Callable[[int, list[ForwardSeq]], bool],
) -> None:
    """`runner.forward` raises on its n-th call (from 1) with `seqs` when `fails(n, seqs)`."""
    forward = runner.forward
    calls = 0

    def failing(seqs: list[ForwardSeq]) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if fails(calls, seqs):
            raise RuntimeError("out of memory at this batch's size")
        return forward(seqs)

    monkeypatch.setattr(runner, "forward", failing)


def test_a_batch_whose_forward_fails_runs_each_request_alone(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The target's batched forward fails once, at the prefill and again at a verify with
    drafts in flight (as a GPU out of memory at that batch's size): each request runs alone
    in that step, and every request gets its own output."""
    reference = _reference(runners, prompts)
    _failing_forward(runners[0], monkeypatch, lambda n, seqs: n in (1, 5) and len(seqs) > 1)
    engine = Engine(*runners, proposer="draft")
    outputs, reasons, drafts = _batched(
        engine, _requests(prompts, CULPRIT_TEMPERATURE), K, _nothing
    )
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert outputs == reference
    assert drafts[0] > 0


@pytest.mark.parametrize("at", [1, 2], ids=["at-its-prefill", "at-its-first-verify"])
def test_a_request_whose_forward_fails_alone_ends_alone(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    at: int,
) -> None:
    """The target's forward fails whenever the culprit's sequence is in it, from its `at`-th
    step: the culprit ends aborted with its tokens before the fault, its KV freed in both
    caches; the others get their own outputs."""
    reference = _reference(runners, prompts)
    engine = Engine(*runners, proposer="draft")
    steps = 0

    def counted(engine: Engine) -> None:
        nonlocal steps
        steps += 1

    def culprit_in(n: int, seqs: list[ForwardSeq]) -> bool:
        table = engine.cache.block_table("r2") if engine.has_request("r2") else []
        return steps + 1 >= at and any(s.block_table[:1] == table[:1] for s in seqs)

    _failing_forward(runners[0], monkeypatch, culprit_in)
    outputs, reasons, _ = _batched(engine, _requests(prompts, CULPRIT_TEMPERATURE), K, counted)
    assert engine.draft is not None
    assert engine.cache.num_tokens("r2") == engine.draft.cache.num_tokens("r2") == 0
    _check_culprit_ended_alone(engine, outputs, reasons, reference, at)


def test_a_draft_prefill_that_fails_leaves_the_drafts_to_catch_up(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The draft's forward fails at its first call, the prompts' draft prefill: the draft
    cache keeps nothing of it, the requests still get their own outputs, and their first
    decodes draft from the whole context."""
    reference = _reference(runners, prompts)
    _failing_forward(runners[1], monkeypatch, lambda n, seqs: n == 1)
    engine = Engine(*runners, proposer="draft")
    cached = []

    def draft_cached(engine: Engine) -> None:
        assert engine.draft is not None
        cached.append([engine.draft.cache.num_tokens(f"r{i}") for i in range(3)])

    outputs, reasons, drafts = _batched(
        engine, _requests(prompts, CULPRIT_TEMPERATURE), K, draft_cached
    )
    assert cached[0] == [0, 0, 0]
    assert set(reasons.values()) == {FinishReason.LENGTH}
    assert outputs == reference
    assert drafts[0] > 0


def test_a_forward_that_always_fails_ends_its_requests_and_frees_their_kv(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No request's forward runs, alone or batched: the step ends them all as aborted (not
    a failed step: the engine knows where every request stands) with no KV left."""
    _failing_forward(runners[0], monkeypatch, lambda n, seqs: True)
    engine = Engine(*runners, proposer="draft")
    requests = _requests(prompts, CULPRIT_TEMPERATURE)
    for r in requests:
        engine.add_request(r)
    outcome = engine.step(
        BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in requests))
    )
    assert {o.request_id: o.finish_reason for o in outcome.outcomes} == {
        r.request_id: FinishReason.ABORT for r in requests
    }
    assert all(not o.new_token_ids for o in outcome.outcomes)
    assert {o.abort_reason for o in outcome.outcomes} == {
        "the replica failed at the model's forward pass for this request; its log says why"
    }
    _release_all(engine, [r.request_id for r in requests])


def test_a_tensor_parallel_forward_fault_is_not_retried_alone(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other ranks of a tensor-parallel group may wait in the failed batch's collectives:
    a forward of one sequence would not match theirs, so the fault fails the step."""
    calls: list[int] = []
    _failing_forward(runners[0], monkeypatch, lambda n, seqs: not calls.append(n))
    monkeypatch.setattr(runners[0], "tp", object())  # as a rank 0's group handle
    engine = Engine(*runners, proposer="draft")
    requests = _requests(prompts, CULPRIT_TEMPERATURE)
    for r in requests:
        engine.add_request(r)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.step(BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in requests)))
    assert calls == [1]
    monkeypatch.undo()
    _release_all(engine, [r.request_id for r in requests])


def test_a_value_error_once_the_step_runs_is_not_a_refusal(
    runners: tuple[ModelRunner, ModelRunner],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica takes a ValueError from a step for "refused, nothing changed" and waits for
    the next plan; one raised after the plan began to run (here, as a request's KV grows)
    must fail the step instead."""
    engine = Engine(*runners, proposer="draft")
    request = _requests(prompts, CULPRIT_TEMPERATURE)[0]
    engine.add_request(request)

    def append(request_id: str, num_tokens: int) -> None:
        raise ValueError("a block table out of step")

    monkeypatch.setattr(engine.cache, "append", append)
    with pytest.raises(StepFailed, match="after it began: a block table") as info:
        engine.step(BatchPlan((PrefillChunk(request.request_id, request.prompt_len),)))
    assert not isinstance(info.value, ValueError)
    monkeypatch.undo()
    engine.abort(request.request_id)
