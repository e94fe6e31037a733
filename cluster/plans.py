"""Fitting a controller's plan to what the replica actually holds, and planning without one.

The controller plans from a virtual copy that lags the replica by the steps in flight, so a
plan may name requests that finished or were aborted, prefill tokens already computed, or
decode a request that is not decoding (yet, or any more). `reconcile` keeps only what is still
valid, so the engine never refuses a plan for being late. `derive_plan` lets a replica keep
decoding with the last plan's shape while the next plan is on its way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from replica.batch import BatchPlan, DecodeStep, PlanEntry, PrefillChunk


@dataclass(frozen=True)
class SeqView:
    """What the engine holds for one request, as far as plan validity goes."""

    num_known: int
    num_computed: int
    num_generated: int
    finished: bool = False

    @property
    def uncomputed(self) -> int:
        return self.num_known - self.num_computed

    @property
    def decoding(self) -> bool:
        return not self.finished and self.num_generated > 0 and self.uncomputed == 1


def reconcile(plan: BatchPlan, seqs: Mapping[str, SeqView]) -> BatchPlan | None:
    """`plan` without entries that no longer apply; None when nothing is left."""
    preempt = tuple(rid for rid in plan.preempt if rid in seqs and not seqs[rid].finished)
    entries: list[PlanEntry] = []
    for entry in plan.entries:
        seq = seqs.get(entry.request_id)
        if seq is None or seq.finished or entry.request_id in preempt:
            continue
        if isinstance(entry, PrefillChunk):
            n = min(entry.num_tokens, seq.uncomputed)
            if n >= 1 and not seq.decoding:
                entries.append(PrefillChunk(entry.request_id, n))
        elif seq.decoding:
            entries.append(entry)
    if not entries and not preempt:
        return None
    return BatchPlan(entries=tuple(entries), preempt=preempt)


def derive_plan(last: BatchPlan | None, seqs: Mapping[str, SeqView]) -> BatchPlan | None:
    """One decode for every decoding request, each with the speculation length the last plan
    gave it (requests new to decoding get the last plan's most common length)."""
    ks = {
        e.request_id: e.num_spec_tokens
        for e in (last.entries if last else ())
        if isinstance(e, DecodeStep)
    }
    common = Counter(ks.values()).most_common(1)
    default_k = common[0][0] if common else 0
    entries = tuple(
        DecodeStep(rid, ks.get(rid, default_k)) for rid, seq in seqs.items() if seq.decoding
    )
    return BatchPlan(entries=entries) if entries else None
