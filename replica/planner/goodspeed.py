"""GOODSPEED's split of a step's draft tokens across its requests (seed paper 003).

The SLOs-Serve planner sizes a step: which requests decode and how many drafts each tier's
TPOT needs (per-tier lengths from one acceptance rate). Requests do not accept alike, though: a
draft proposed for a request the draft model predicts badly is mostly thrown away. GOODSPEED
re-splits the drafts to maximize sum_i log(goodput_i) (proportional fairness): with acceptance
a_i, S drafts are worth x(S) = (1 - a^(S+1)) / (1 - a) tokens, so the (S+1)-th draft adds
a_i^(S+1), weighed by 1 / X_i (X_i: the request's recent tokens per step). The gains shrink as
S grows, so handing the drafts out one at a time to the largest gain is exactly optimal.

Drafts move only between requests of one tier (the same TPOT), so each tier keeps the drafts
its deadlines were planned with, and a request takes at most the longest length the plan gave
any request, so the step keeps the planner's draft forwards and query tokens.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

from replica.batch import BatchOutcome, BatchPlan, DecodeStep
from replica.planner.budget import AcceptanceEstimate, outcome_judged
from replica.planner.config import GoodspeedConfig


@dataclass
class _Source:
    """A request's EMA acceptance (a_i) and tokens per step (X_i)."""

    acceptance: float
    goodput: float = 1.0


class GoodspeedSplit:
    """Per-request estimates folded from every step, and the split they give."""

    def __init__(self, config: GoodspeedConfig, prior: AcceptanceEstimate) -> None:
        """`prior`: the planner's acceptance over all requests, a new request's a_i."""
        self.config = config
        self.prior = prior
        self._sources: dict[str, _Source] = {}

    def _clipped(self, acceptance: float) -> float:
        eps = self.config.eps
        return min(1.0 - eps, max(eps, acceptance))

    def _source(self, request_id: str) -> _Source:
        source = self._sources.get(request_id)
        if source is None:
            source = self._sources[request_id] = _Source(self._clipped(self.prior.value))
        return source

    def _estimate(self, request_id: str) -> _Source:
        """A request's estimates, or the prior's for one never observed (not stored: a
        split only reads)."""
        return self._sources.get(request_id) or _Source(self._clipped(self.prior.value))

    def split(
        self, plan: BatchPlan, remaining: dict[str, int], tiers: dict[str, float]
    ) -> BatchPlan:
        """`plan` with its decodes' drafts re-split within each tier; `remaining`: each
        decoding request's output tokens to go (it drafts at most one fewer); `tiers`: the
        TPOT each is held to (decodes without one, and those the planner gave no drafts, keep
        theirs)."""
        groups: dict[float, list[tuple[int, DecodeStep]]] = {}
        longest = 0
        for i, entry in enumerate(plan.entries):
            if isinstance(entry, DecodeStep) and entry.num_spec_tokens > 0:
                longest = max(longest, entry.num_spec_tokens)
                tier = tiers.get(entry.request_id)
                if tier is not None:
                    groups.setdefault(tier, []).append((i, entry))
        entries = list(plan.entries)
        for group in groups.values():
            if len(group) < 2:
                continue
            drafts = self._drafts(group, remaining, longest)
            for (i, entry), k in zip(group, drafts, strict=True):
                entries[i] = DecodeStep(entry.request_id, k)
        return replace(plan, entries=tuple(entries))

    def _drafts(
        self, group: list[tuple[int, DecodeStep]], remaining: dict[str, int], longest: int
    ) -> list[int]:
        """The group's drafts handed out one at a time to the largest marginal gain."""
        budget = sum(e.num_spec_tokens for _, e in group)
        caps = [min(longest, remaining[e.request_id] - 1) for _, e in group]
        sources = [self._estimate(e.request_id) for _, e in group]
        given = [0] * len(group)
        heap = [(-s.acceptance / s.goodput, j) for j, s in enumerate(sources) if caps[j] > 0]
        heapq.heapify(heap)
        while budget > 0 and heap:
            _, j = heapq.heappop(heap)
            given[j] += 1
            budget -= 1
            if given[j] < caps[j]:
                source = sources[j]
                gain = source.acceptance ** (given[j] + 1) / source.goodput
                heapq.heappush(heap, (-gain, j))
        return given

    def observe(self, plan: BatchPlan, outcome: BatchOutcome) -> None:
        """Fold each decode of `plan` into its request's estimates: tokens per step always
        (a request given no drafts then climbs back as its goodput falls), acceptance only
        when it drafted (nothing else was judged)."""
        eta, beta = self.config.acceptance_weight, self.config.goodput_weight
        results = {r.request_id: r for r in outcome.outcomes}
        for entry in plan.entries:
            result = results.get(entry.request_id)
            if not isinstance(entry, DecodeStep) or result is None:
                continue
            source = self._source(entry.request_id)
            if result.num_draft_tokens > 0:
                judged = outcome_judged(result)
                rate = result.num_accepted_tokens / judged
                source.acceptance = self._clipped((1 - eta) * source.acceptance + eta * rate)
            tokens = result.num_accepted_tokens + 1
            source.goodput = (1 - beta) * source.goodput + beta * tokens

    def forget(self, request_id: str) -> None:
        self._sources.pop(request_id, None)
