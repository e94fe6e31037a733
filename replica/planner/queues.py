"""Running and waiting requests of one replica and the KV blocks they hold.

Every local scheduler (vllm, sarathi, slos) keeps its requests here, so they all count memory
the same way and fold outcomes in the same way. Blocks are derived, never stored: a running
request holds the blocks of its computed tokens (the engine frees rejected speculative slots
when it rolls back), a waiting request holds none (one started from a cached prefix takes its
blocks when it runs).

`schedule()` must not change scheduler state (a virtual replica may plan without executing), so
a policy builds its plan on a `StepBuilder`, which tracks the step's claims on a scratch view;
the plan's admissions and preemptions take effect in `RequestQueues.apply`, with the outcome.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Set

from replica.batch import BatchOutcome, BatchPlan, DecodeStep, PlanEntry, PrefillChunk
from replica.kv_cache import prefix_limit
from replica.planner.base import CacheBudget, RequestState
from replica.request import Request


def peak_tokens(request: Request) -> int:
    """The most KV slots a request ever holds: its last token is sampled, never fed."""
    return request.prompt_len + request.sampling.max_tokens - 1


def spec_len(state: RequestState, spec_k: int) -> int:
    """Speculative tokens for a decode: at most `spec_k`, never more than the output can take
    (a verify appends up to k + 1 tokens)."""
    return max(0, min(spec_k, state.remaining_output - 1))


class RequestQueues:
    """FCFS waiting queue, running list in admission order (newest last), per-request state."""

    def __init__(self, budget: CacheBudget) -> None:
        if budget.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {budget.num_blocks}")
        if budget.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {budget.block_size}")
        self.budget = budget
        self.states: dict[str, RequestState] = {}
        self.waiting: deque[str] = deque()
        self.running: list[str] = []

    def add(self, request: Request, cached: int = 0) -> RequestState:
        """Queue a request at the back; refuse one that could never fit the cache alone.
        `cached`: leading prompt tokens the replica's prefix cache holds, counted computed
        (the replica attaches them as its prefill begins), so they are neither planned nor
        priced again; the request holds their blocks once it runs."""
        if request.request_id in self.states:
            raise ValueError(f"request {request.request_id!r} is already queued")
        if not 0 <= cached <= prefix_limit(request.prompt_len, 0):
            raise ValueError(
                f"request {request.request_id!r} cannot start from {cached} cached tokens of "
                f"its {request.prompt_len}-token prompt"
            )
        need = self.budget.blocks_for(peak_tokens(request))
        if need > self.budget.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {need} KV blocks at its longest "
                f"(prompt {request.prompt_len} + max_tokens {request.sampling.max_tokens}); "
                f"the cache has {self.budget.num_blocks}"
            )
        state = RequestState(request, num_computed_tokens=cached)
        self.states[request.request_id] = state
        self.waiting.append(request.request_id)
        return state

    def abort(self, request_id: str) -> bool:
        """Forget a request (aborted, or finished); False if it is unknown."""
        state = self.states.pop(request_id, None)
        if state is None:
            return False
        if request_id in self.running:
            self.running.remove(request_id)
        else:
            self.waiting.remove(request_id)
        return True

    def held_blocks(self, state: RequestState) -> int:
        return self.budget.blocks_for(state.num_computed_tokens)

    def blocks_of(self, state: RequestState, running: Set[str]) -> int:
        """The blocks `state` holds: its computed tokens' while it runs (`running`: the running
        ids), none while it waits, even started from a cached prefix (attaching the prefix
        takes its blocks from those free)."""
        return self.held_blocks(state) if state.request_id in running else 0

    def used_blocks(self) -> int:
        return sum(self.held_blocks(self.states[rid]) for rid in self.running)

    def free_blocks(self) -> int:
        return self.budget.num_blocks - self.used_blocks()

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def running_states(self) -> Iterator[RequestState]:
        return (self.states[rid] for rid in self.running)

    def waiting_states(self) -> Iterator[RequestState]:
        return (self.states[rid] for rid in self.waiting)

    def apply(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> list[RequestState]:
        """Fold an executed plan in: preempt, admit, then apply the outcome.

        Preempted requests go to the front of the waiting queue (oldest first) with their tokens
        kept; admitted ones join the running list in plan order. Requests aborted since the
        plan was made are skipped. Returns the requests that finished (already forgotten).
        """
        victims = set(plan.preempt)
        preempted = [rid for rid in self.running if rid in victims]
        for rid in preempted:
            self.states[rid].num_computed_tokens = 0
        self.running = [rid for rid in self.running if rid not in victims]
        self.waiting.extendleft(reversed(preempted))
        running = set(self.running)
        for entry in plan.entries:
            rid = entry.request_id
            if rid in self.states and rid not in running:
                self.waiting.remove(rid)
                self.running.append(rid)
        finished: list[RequestState] = []
        for result in outcome.outcomes:
            state = self.states.get(result.request_id)
            if state is None:
                continue
            state.apply(result.new_token_ids, result.num_computed_tokens, result.finished, now)
            if state.finished or state.remaining_output <= 0:
                state.finished = True
                finished.append(state)
                self.abort(state.request_id)
        return finished


class StepBuilder:
    """One plan under construction: its token budget, the blocks it claims, the requests it
    preempts. A policy only decides what to run next and in which order."""

    def __init__(self, queues: RequestQueues, token_budget: int) -> None:
        self.queues = queues
        self._running = set(queues.running)
        self.tokens_left = token_budget
        self.free_blocks = queues.free_blocks()
        self.num_running = len(queues.running)
        self.entries: list[PlanEntry] = []
        self.preempted: list[str] = []
        self._scheduled: set[str] = set()

    def is_scheduled(self, request_id: str) -> bool:
        return request_id in self._scheduled

    def is_preempted(self, request_id: str) -> bool:
        return request_id in self.preempted

    def growth_blocks(self, state: RequestState, num_tokens: int) -> int:
        """Blocks beyond what the request holds to feed `num_tokens` more tokens."""
        computed = state.num_computed_tokens + num_tokens
        return self.queues.budget.blocks_for(computed) - self.queues.blocks_of(state, self._running)

    def admission_blocks(self, state: RequestState, spec_k: int) -> int:
        """Blocks a waiting request needs to be admitted: all its known tokens plus its first
        decode step (with speculative slots), so admitting it does not force a preemption at
        once."""
        first_decode = 1 + min(spec_k, max(0, state.remaining_output - 2))
        tokens = min(state.num_known_tokens + first_decode, peak_tokens(state.request))
        return self.queues.budget.blocks_for(tokens)

    def tokens_fitting(self, state: RequestState) -> int:
        """The most tokens `state` can feed in the blocks still free in this step."""
        size = self.queues.budget.block_size
        slack = -state.num_computed_tokens % size
        return slack + self.free_blocks * size

    def add_prefill(self, state: RequestState, num_tokens: int) -> None:
        self._claim(state, PrefillChunk(state.request_id, num_tokens), num_tokens)
        if state.request_id not in self.queues.running:
            self.num_running += 1

    def add_decode(self, state: RequestState, num_spec_tokens: int) -> None:
        self._claim(state, DecodeStep(state.request_id, num_spec_tokens), 1 + num_spec_tokens)

    def _claim(self, state: RequestState, entry: PlanEntry, num_tokens: int) -> None:
        blocks = self.growth_blocks(state, num_tokens)
        if num_tokens > self.tokens_left or blocks > self.free_blocks:
            raise ValueError(
                f"step cannot take {num_tokens} tokens / {blocks} blocks for "
                f"{state.request_id!r}: {self.tokens_left} tokens / {self.free_blocks} blocks left"
            )
        self.tokens_left -= num_tokens
        self.free_blocks -= blocks
        self._scheduled.add(state.request_id)
        self.entries.append(entry)

    def make_room(self, state: RequestState, blocks: int, *, may_preempt_self: bool) -> bool:
        """Preempt the newest running requests not in this step until `blocks` are free.

        A request never loses memory to a newer one. If `state` is itself the newest left,
        it is preempted when `may_preempt_self` (a decode cannot shrink), else the caller
        makes do with what is free. Returns whether `blocks` are free.
        """
        while self.free_blocks < blocks:
            victim = self._newest_unscheduled()
            if victim is None or (victim is state and not may_preempt_self):
                return False
            self.preempt(victim)
            if victim is state:
                return False
        return True

    def preempt(self, state: RequestState) -> None:
        self.preempted.append(state.request_id)
        self.free_blocks += self.queues.held_blocks(state)
        self.num_running -= 1

    def _newest_unscheduled(self) -> RequestState | None:
        for rid in reversed(self.queues.running):
            if not self.is_scheduled(rid) and not self.is_preempted(rid):
                return self.queues.states[rid]
        return None

    def schedule_decodes(self, spec_k: int) -> None:
        """Give every running decode its token (+ speculation), oldest first, preempting the
        newest running requests when memory runs out; stops when the token budget does."""
        for state in list(self.queues.running_states()):
            if self.tokens_left < 1:
                return
            rid = state.request_id
            if self.is_preempted(rid) or self.is_scheduled(rid) or not state.is_decoding:
                continue
            k = min(spec_len(state, spec_k), self.tokens_left - 1)
            if self.make_room(state, self.growth_blocks(state, 1 + k), may_preempt_self=True):
                self.add_decode(state, k)

    def build(self) -> BatchPlan | None:
        if not self.entries and not self.preempted:
            return None
        return BatchPlan(entries=tuple(self.entries), preempt=tuple(self.preempted))
