"""The vLLM baseline: prefill-first FCFS without chunking.

Each step either prefills waiting requests, each in one chunk (its whole prompt, or prompt and
output when resuming after preemption), or, when no prefill fits, decodes every running
request. Prefills therefore stall all decodes, which is the TPOT failure SLOs-Serve is compared
against (vLLM v0's default scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass

from replica.batch import BatchOutcome, BatchPlan
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.config import check_int
from replica.planner.queues import RequestQueues, StepBuilder, peak_tokens
from replica.request import Request


@dataclass(frozen=True)
class VllmConfig:
    max_num_batched_tokens: int = 2048
    """Most query tokens per step; since prefills are never chunked it also bounds a request's
    prompt + max_tokens (a resume feeds prompt and output at once)."""
    max_num_seqs: int = 256
    """Most running requests."""
    spec_k: int = 0
    """Speculative tokens per decode (0: none)."""

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("spec_k", self.spec_k, 0)


class VllmScheduler(Scheduler):
    """Prefill-first FCFS; admission stops at the first waiting request that does not fit."""

    def __init__(self, budget: CacheBudget, config: VllmConfig | None = None) -> None:
        self.config = config or VllmConfig()
        self.queues = RequestQueues(budget)

    def add_request(self, request: Request, now: float, cached: int = 0) -> None:
        longest_prefill = peak_tokens(request)
        if longest_prefill > self.config.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r} may need a {longest_prefill}-token prefill "
                f"(prompt + max_tokens - 1); max_num_batched_tokens is "
                f"{self.config.max_num_batched_tokens} and prefills are not chunked"
            )
        self.queues.add(request, cached)

    def abort_request(self, request_id: str) -> None:
        self.queues.abort(request_id)

    def schedule(self, now: float) -> BatchPlan | None:
        step = StepBuilder(self.queues, self.config.max_num_batched_tokens)
        self._admit_prefills(step)
        if not step.entries:
            step.schedule_decodes(self.config.spec_k)
        return step.build()

    def _admit_prefills(self, step: StepBuilder) -> None:
        for state in list(self.queues.running_states()):
            # Short of its prompt: the cached prefix it started from was not found whole.
            if not state.is_decoding and not step.is_preempted(state.request_id):
                num_tokens = state.num_uncomputed
                if num_tokens > step.tokens_left or not step.make_room(
                    state, step.growth_blocks(state, num_tokens), may_preempt_self=False
                ):
                    return
                step.add_prefill(state, num_tokens)
        for state in self.queues.waiting_states():
            num_tokens = state.num_uncomputed
            if (
                step.num_running >= self.config.max_num_seqs
                or num_tokens > step.tokens_left
                or step.admission_blocks(state, self.config.spec_k) > step.free_blocks
            ):
                return
            step.add_prefill(state, num_tokens)

    def update_from_outcome(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        self.queues.apply(plan, outcome, now)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()
