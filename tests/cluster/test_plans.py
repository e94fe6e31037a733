"""Fitting stale plans to the engine's state, and deriving plans while none arrives."""

from __future__ import annotations

from cluster.plans import SeqView, derive_plan, reconcile
from replica.batch import BatchPlan, DecodeStep, PrefillChunk

PREFILLING = SeqView(num_known=10, num_computed=4, num_generated=0)
DECODING = SeqView(num_known=12, num_computed=11, num_generated=2)
FINISHED = SeqView(num_known=12, num_computed=11, num_generated=2, finished=True)


def test_reconcile_keeps_a_valid_plan_unchanged() -> None:
    plan = BatchPlan((PrefillChunk("p", 6), DecodeStep("d", 2)))
    assert reconcile(plan, {"p": PREFILLING, "d": DECODING}) == plan


def test_reconcile_drops_finished_and_unknown_requests() -> None:
    plan = BatchPlan((DecodeStep("gone"), DecodeStep("done"), DecodeStep("d")), preempt=("x",))
    assert reconcile(plan, {"done": FINISHED, "d": DECODING}) == BatchPlan((DecodeStep("d"),))


def test_reconcile_clips_prefill_to_what_remains() -> None:
    plan = BatchPlan((PrefillChunk("p", 50),))
    assert reconcile(plan, {"p": PREFILLING}) == BatchPlan((PrefillChunk("p", 6),))


def test_reconcile_drops_prefill_of_a_request_already_decoding() -> None:
    assert reconcile(BatchPlan((PrefillChunk("d", 3),)), {"d": DECODING}) is None


def test_reconcile_drops_decode_of_a_request_not_decoding() -> None:
    plan = BatchPlan((DecodeStep("p", 1), PrefillChunk("q", 2)))
    fitted = reconcile(plan, {"p": PREFILLING, "q": PREFILLING})
    assert fitted == BatchPlan((PrefillChunk("q", 2),))


def test_reconcile_keeps_preemption_of_held_requests_only() -> None:
    plan = BatchPlan((DecodeStep("d"),), preempt=("p", "done", "gone"))
    fitted = reconcile(plan, {"d": DECODING, "p": PREFILLING, "done": FINISHED})
    assert fitted == BatchPlan((DecodeStep("d"),), preempt=("p",))


def test_derive_plan_decodes_every_decoding_request_with_the_last_shape() -> None:
    last = BatchPlan((DecodeStep("a", 3), DecodeStep("b", 3), DecodeStep("c", 1)))
    seqs = {"a": DECODING, "c": DECODING, "new": DECODING, "p": PREFILLING, "f": FINISHED}
    assert derive_plan(last, seqs) == BatchPlan(
        (DecodeStep("a", 3), DecodeStep("c", 1), DecodeStep("new", 3))
    )


def test_derive_plan_without_decoders_or_history() -> None:
    assert derive_plan(None, {"p": PREFILLING}) is None
    assert derive_plan(None, {"d": DECODING}) == BatchPlan((DecodeStep("d", 0),))
