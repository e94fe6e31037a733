"""LAPS-SD's order inside the best-effort tier: least attained service first, and the
shortest predicted remaining time once a request's acceptance has settled.

Best-effort work has no deadline, so what is worth minimizing there is mean latency. LAPS-SD
(seed paper 004) is semi-clairvoyant: a request's remaining time is predictable only once its
speculative acceptance rate has stopped moving, so until then it is served least-attained-
service first (which favours short jobs without knowing them), and after it shortest predicted
time first; a predictable request holding KV runs to completion (preempting it would drop its
KV and compute it again). Strict priority between levels would starve a long request under
steady short arrivals, so waiting without service lifts a request one level per `aging_s`.
A request that never drafts (the planner gives best-effort decodes no drafts) has a constant
rate and is predictable after `window` steps, so here the levels order mostly the requests not
yet started or preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replica.batch import BatchOutcome, BatchPlan
from replica.planner.base import RequestState
from replica.planner.config import LapsConfig


@dataclass
class _Service:
    """What LAPS-SD knows of one request."""

    last_served: float
    rates: deque[float]
    """The cumulative acceptance rate after each of its latest `window` steps."""
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    draft_len: int = 0
    """Drafts of its latest step (n in the time estimate)."""


class LapsOrder:
    """Attained service and acceptance per request, folded from every executed step."""

    def __init__(self, config: LapsConfig) -> None:
        self.config = config
        self._levels = [
            config.first_level_s * config.growth**j for j in range(config.num_levels - 1)
        ]
        self._service: dict[str, _Service] = {}
        self.target_step_s = 0.0
        """T_llm: the latest step's target time."""
        self.draft_step_s = 0.0
        """T_ssm: the latest drafting step's time per draft forward."""

    def observe(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        """Every request in the step attained its whole time (it waited on all of it)."""
        self.target_step_s = outcome.target_s + outcome.overhead_s
        drafts = max((r.num_draft_tokens for r in outcome.outcomes), default=0)
        if drafts > 0:
            self.draft_step_s = outcome.draft_s / drafts
        results = {r.request_id: r for r in outcome.outcomes}
        for entry in plan.entries:
            rid = entry.request_id
            service = self._service.get(rid)
            if service is None:
                window: deque[float] = deque(maxlen=self.config.window)
                service = self._service[rid] = _Service(last_served=now, rates=window)
            service.seconds += outcome.total_s
            service.last_served = now
            result = results.get(rid)
            if result is None:
                continue
            service.draft_len = result.num_draft_tokens
            service.drafted += result.num_draft_tokens
            service.accepted += result.num_accepted_tokens
            rate = service.accepted / service.drafted if service.drafted else 0.0
            service.rates.append(rate)

    def forget(self, request_id: str) -> None:
        self._service.pop(request_id, None)

    def level(self, state: RequestState, now: float) -> int:
        """The request's queue (0 first) after aging."""
        service = self._service.get(state.request_id)
        if service is None:
            return 0
        level = sum(service.seconds >= end for end in self._levels)
        lifted = int((now - service.last_served) // self.config.aging_s)
        return max(0, level - lifted)

    def predicted_s(
        self, state: RequestState, remaining_tokens: Callable[[RequestState], int]
    ) -> float | None:
        """T = L (n T_ssm + T_llm) / (n A + 1) once the acceptance rate is stable, else None
        (L, `remaining_tokens`, is asked only then)."""
        service = self._service.get(state.request_id)
        if service is None or len(service.rates) < self.config.window:
            return None
        rates = service.rates
        if max(rates) - min(rates) >= self.config.stable_spread:
            return None
        acceptance = sum(rates) / len(rates)
        n = service.draft_len
        per_step = n * self.draft_step_s + self.target_step_s
        return remaining_tokens(state) * per_step / (n * acceptance + 1)

    def order(
        self,
        states: Sequence[RequestState],
        remaining_tokens: Callable[[RequestState], int],
        now: float,
    ) -> list[RequestState]:
        """Predictable requests holding KV first, shortest predicted time first: they run to
        completion, since preempting one drops its KV and recomputes it. Then the rest by
        level, and within a level the predictable ones by shortest predicted time, then the
        others in their given (arrival) order."""

        def key(item: tuple[int, RequestState]) -> tuple[int, int, float]:
            i, state = item
            predicted = self.predicted_s(state, remaining_tokens)
            if predicted is None:
                return (1 + self.level(state, now), 1, float(i))
            if state.num_computed_tokens > 0:
                return (0, 0, predicted)
            return (1 + self.level(state, now), 0, predicted)

        return [state for _, state in sorted(enumerate(states), key=key)]
