"""The Sarathi-Serve baseline: chunked prefill, decode-first, a fixed token budget per step.

Every running decode gets its token first; prefill chunks (running requests' unfinished
prompts, then waiting requests FCFS) fill what is left of the budget. Decodes never stall, so
TPOT holds at the price of TTFT under bursts. The budget is fixed per replica: pick it from the
tightest TPOT with the perf model (the largest step that still fits it).
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.batch import BatchOutcome, BatchPlan
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.config import check_int
from replica.planner.queues import RequestQueues, StepBuilder
from replica.request import Request


@dataclass(frozen=True)
class SarathiConfig:
    token_budget: int = 512
    """Query tokens per step (decodes + prefill chunks): Sarathi-Serve's chunk size."""
    max_num_seqs: int = 256
    """Most running requests."""
    spec_k: int = 0
    """Speculative tokens per decode (0: none)."""

    def __post_init__(self) -> None:
        check_int("token_budget", self.token_budget, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("spec_k", self.spec_k, 0)


class SarathiScheduler(Scheduler):
    """Decode-first with chunked prefill. Admission stops at the first waiting request that
    does not fit, and in steps where memory is short (a preemption, or a running prefill cut
    short): a preempted request, back at the head of the queue, must not be overtaken."""

    def __init__(self, budget: CacheBudget, config: SarathiConfig | None = None) -> None:
        self.config = config or SarathiConfig()
        self.queues = RequestQueues(budget)

    def add_request(self, request: Request, now: float, cached: int = 0) -> None:
        self.queues.add(request, cached)

    def abort_request(self, request_id: str) -> None:
        self.queues.abort(request_id)

    def schedule(self, now: float) -> BatchPlan | None:
        step = StepBuilder(self.queues, self.config.token_budget)
        step.schedule_decodes(self.config.spec_k)
        if self._continue_prefills(step) and not step.preempted:
            self._admit_prefills(step)
        return step.build()

    def _continue_prefills(self, step: StepBuilder) -> bool:
        """Next chunks of running prompts, oldest first; False if one was short of memory.

        A chunk may preempt newer requests not in the step; failing that it shrinks to the
        free blocks, so an older prompt is never preempted for a newer decode.
        """
        for state in list(self.queues.running_states()):
            rid = state.request_id
            if step.tokens_left < 1:
                return True
            if step.is_preempted(rid) or step.is_scheduled(rid) or state.is_decoding:
                continue
            num_tokens = min(state.num_uncomputed, step.tokens_left)
            step.make_room(state, step.growth_blocks(state, num_tokens), may_preempt_self=False)
            num_tokens = min(num_tokens, step.tokens_fitting(state))
            if num_tokens < 1:
                return False
            step.add_prefill(state, num_tokens)
            if num_tokens < state.num_uncomputed and step.tokens_left > 0:
                return False
        return True

    def _admit_prefills(self, step: StepBuilder) -> None:
        for state in self.queues.waiting_states():
            if (
                step.tokens_left < 1
                or step.num_running >= self.config.max_num_seqs
                or step.admission_blocks(state, self.config.spec_k) > step.free_blocks
            ):
                return
            step.add_prefill(state, min(state.num_uncomputed, step.tokens_left))

    def update_from_outcome(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        self.queues.apply(plan, outcome, now)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()
