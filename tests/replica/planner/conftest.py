"""A token-count engine for scheduler tests, as vLLM's scheduler tests use hand-made outputs.

`CountingEngine` runs a `BatchPlan` on counts alone and checks it the way the real engine
does (chunk sizes, decode readiness, speculation bounds, KV capacity). Each output token is a
fixed function of (request, position), so a preempted request that recomputes must end with
exactly the tokens it would have had without preemption.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st

from replica.batch import (
    BatchOutcome,
    BatchPlan,
    FinishReason,
    PlanEntry,
    PrefillChunk,
    RequestOutcome,
)
from replica.planner.base import CacheBudget, Scheduler
from replica.request import Request, SamplingParams, Tier

Accept = Callable[[str, int], int]


def token_at(request_id: str, position: int) -> int:
    """The token a request holds at a position, whatever the batching."""
    return (sum(map(ord, request_id)) * 7919 + position) % 1000


def expected_output(request: Request) -> list[int]:
    return [
        token_at(request.request_id, request.prompt_len + j)
        for j in range(request.sampling.max_tokens)
    ]


def make_request(request_id: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id,
        [7] * prompt_len,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        tier=Tier.BEST_EFFORT,
    )


class CountingEngine:
    """Executes plans on token counts; accepts `accept(request_id, k)` of k speculative tokens."""

    def __init__(self, budget: CacheBudget, accept: Accept | None = None) -> None:
        self.budget = budget
        self.accept: Accept = accept or (lambda _rid, k: k)
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.finished: dict[str, list[int]] = {}
        self.peak_blocks = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.outputs[request.request_id] = []
        self.computed[request.request_id] = 0

    def abort(self, request_id: str) -> None:
        self._drop(request_id)

    def used_blocks(self) -> int:
        return sum(self.budget.blocks_for(c) for c in self.computed.values())

    def step(self, plan: BatchPlan) -> BatchOutcome:
        for rid in plan.preempt:
            assert rid in self.requests, f"preempting unknown {rid}"
            self.computed[rid] = 0
        blocks = self.used_blocks()
        for entry in plan.entries:
            fed = entry.num_tokens if isinstance(entry, PrefillChunk) else 1 + entry.num_spec_tokens
            computed = self.computed[entry.request_id]
            blocks += self.budget.blocks_for(computed + fed) - self.budget.blocks_for(computed)
        assert blocks <= self.budget.num_blocks, f"plan needs {blocks} blocks"
        self.peak_blocks = max(self.peak_blocks, blocks)
        return BatchOutcome([self._run(entry) for entry in plan.entries])

    def _run(self, entry: PlanEntry) -> RequestOutcome:
        rid = entry.request_id
        request, out = self.requests[rid], self.outputs[rid]
        known = request.prompt_len + len(out)
        drafted = accepted = 0
        if isinstance(entry, PrefillChunk):
            assert 1 <= entry.num_tokens <= known - self.computed[rid], entry
            self.computed[rid] += entry.num_tokens
            new = [token_at(rid, known)] if self.computed[rid] == known else []
        else:
            drafted = entry.num_spec_tokens
            assert out and known - self.computed[rid] == 1, f"{rid} is not decoding"
            assert drafted <= request.sampling.max_tokens - len(out) - 1, "over-speculation"
            accepted = self.accept(rid, drafted)
            new = [token_at(rid, known + i) for i in range(accepted + 1)]
            self.computed[rid] = known + accepted
        out.extend(new)
        assert len(out) <= request.sampling.max_tokens, f"{rid} over-generated"
        reason = FinishReason.LENGTH if len(out) == request.sampling.max_tokens else None
        result = RequestOutcome(
            rid,
            new,
            self.computed[rid],
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            finish_reason=reason,
        )
        if reason is not None:
            self.finished[rid] = list(out)
            self._drop(rid)
        return result

    def _drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.outputs.pop(request_id, None)
        self.computed.pop(request_id, None)


def submit(scheduler: Scheduler, engine: CountingEngine, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request, 0.0)
        engine.add(request)


def advance(scheduler: Scheduler, engine: CountingEngine, now: float = 0.0) -> BatchPlan:
    """Plan, execute and fold in one step; the scheduler must have work."""
    plan = scheduler.schedule(now)
    assert plan is not None, "nothing scheduled"
    scheduler.update_from_outcome(plan, engine.step(plan), now)
    return plan


def run_workload(
    scheduler: Scheduler,
    engine: CountingEngine,
    arrivals: Sequence[tuple[int, Request]],
    max_steps: int = 5000,
) -> list[BatchPlan]:
    """Feed arrivals at their step numbers and run until everything finished; the step number
    is the clock. Fails if the scheduler idles or loops with work left."""
    pending = sorted(arrivals, key=lambda a: a[0])
    plans: list[BatchPlan] = []
    now = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= now:
            request = pending.pop(0)[1]
            engine.add(request)
            scheduler.add_request(request, float(now))
        plan = scheduler.schedule(float(now))
        if plan is None:
            assert pending, "scheduler idles with unfinished requests"
            now = pending[0][0]
            continue
        outcome = engine.step(plan)
        now += 1
        scheduler.update_from_outcome(plan, outcome, float(now))
        plans.append(plan)
        assert len(plans) < max_steps, "no progress"
    return plans


@pytest.fixture(scope="session")
def counting_engine() -> type[CountingEngine]:
    return CountingEngine


@pytest.fixture(scope="session")
def add() -> Callable[..., None]:
    return submit


@pytest.fixture(scope="session")
def step() -> Callable[..., BatchPlan]:
    return advance


@pytest.fixture(scope="session")
def workload() -> Callable[..., list[BatchPlan]]:
    return run_workload


@pytest.fixture(scope="session")
def new_request() -> Callable[[str, int, int], Request]:
    return make_request


@pytest.fixture(scope="session")
def expected() -> Callable[[Request], list[int]]:
    return expected_output


@dataclass(frozen=True)
class RandomWorkload:
    """A drawn workload that fits the cache: the longest request fits alone."""

    block_size: int
    num_blocks: int
    longest: int
    """Most tokens one request holds (prompt + max_tokens - 1)."""
    requests: list[tuple[float, Request]]
    accept: Callable[[str, int], int]
    """Accepted drafts per decode, cycling through a drawn pattern."""


def draw_workload(data: st.DataObject, max_prompt: int) -> RandomWorkload:
    block_size = data.draw(st.integers(1, 8), label="block_size")
    shapes = data.draw(
        st.lists(
            st.tuples(st.integers(0, 30), st.integers(1, max_prompt), st.integers(1, 20)),
            min_size=1,
            max_size=8,
        ),
        label="arrival, prompt, max_tokens",
    )
    longest = max(p + m - 1 for _, p, m in shapes)
    least_blocks = -(-longest // block_size)
    num_blocks = data.draw(st.integers(least_blocks, 3 * least_blocks), label="num_blocks")
    accepts = itertools.cycle(data.draw(st.lists(st.integers(0, 4), min_size=1), label="accept"))
    return RandomWorkload(
        block_size=block_size,
        num_blocks=num_blocks,
        longest=longest,
        requests=[(t, make_request(f"r{i}", p, m)) for i, (t, p, m) in enumerate(shapes)],
        accept=lambda _rid, k: min(k, next(accepts)),
    )


@pytest.fixture(scope="session")
def random_workload() -> Callable[[st.DataObject, int], RandomWorkload]:
    return draw_workload
