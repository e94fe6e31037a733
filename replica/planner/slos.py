"""The SLOs-Serve scheduler for one replica (Algorithm 1 with soft admission control).

New requests wait for the next planning invocation, where the DP admits the most valuable set
whose SLOs it can guarantee next to the running ones (forced in). Declined requests join the
best-effort tier, which runs on the time SLO work leaves in a batch and on unreserved memory
(the budget does not count it, so it never shrinks what the DP may promise), and is preempted
when admitted requests need the memory. The tier serves first the requests that can still meet
their next deadline, earliest first, and offers those without a first token to every replan's
DP again: the paper's burst resilience, where requests deferred in a surge are served, and
guaranteed, as soon as load allows, and the ones already late wait for idle time. A cluster
controller asks
`plan_admission` for a verdict without changing anything, then binds the request here with
`add_admitted`, or routes it on.
With `PlannerConfig.output_estimate`, an admitted request reserves KV for an estimated output
(replica.planner.output_estimate) instead of max_tokens, and grows it as it goes.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np

from replica.batch import BatchOutcome, BatchPlan, DecodeStep, RequestOutcome
from replica.perf_model import BatchShape, BatchTimeModel, attention_pairs
from replica.planner.admission import (
    AdmissionProblem,
    AdmissionResult,
    Candidate,
    RunningDecoders,
    RunningPrefill,
    solve_admission,
)
from replica.planner.base import CacheBudget, RequestState, Scheduler
from replica.planner.batching import SloWork, form_batch
from replica.planner.budget import (
    AcceptanceEstimate,
    BatchBudget,
    TierLoad,
    WorstBatch,
    outcome_judged,
    plan_budgets,
)
from replica.planner.config import PlannerConfig
from replica.planner.deadlines import (
    chain_period,
    early_stage_starts,
    prefill_deadline,
    remaining_tpot,
    token_deadline,
    upcoming_deadlines,
)
from replica.planner.goodspeed import GoodspeedSplit
from replica.planner.invocation import InvocationPolicy, lags
from replica.planner.laps import LapsOrder
from replica.planner.output_estimate import OutputLengthEstimate
from replica.planner.queues import RequestQueues, peak_tokens
from replica.request import Request, Tier

HISTORY = 10_000
"""Requests the verdict, demotion and promotion histories keep (the oldest are dropped): enough
to inspect a run, bounded for a controller that plans for days."""
_LATE_EPS_S = 1e-9
"""A token this much past its deadline is on time (float rounding of the same instant)."""


class SlosScheduler(Scheduler):
    """DP admission + EDF batch formation + best-effort tier, replanned by InvocationPolicy."""

    def __init__(
        self, perf: BatchTimeModel, cache: CacheBudget, config: PlannerConfig | None = None
    ) -> None:
        self.perf = perf
        self.config = config or PlannerConfig()
        self.queues = RequestQueues(cache)
        self.pending: list[str] = []
        self.best_effort: list[str] = []
        spec = self.config.spec
        self.acceptance = AcceptanceEstimate(spec) if spec is not None else None
        goodspeed = self.config.goodspeed
        self.goodspeed = (
            GoodspeedSplit(goodspeed, self.acceptance)
            if goodspeed is not None and self.acceptance is not None
            else None
        )
        self.invocation = InvocationPolicy(self.config.invocation)
        estimate = self.config.output_estimate
        self.lengths = OutputLengthEstimate(estimate) if estimate is not None else None
        laps = self.config.laps
        self.laps = LapsOrder(laps) if laps is not None else None
        self._busy_until = 0.0
        """When the batch this scheduler last planned is predicted to end."""
        self.demoted: deque[str] = deque(maxlen=HISTORY)
        """Admitted requests that lost their guarantee: outgrown reservations left no memory,
        or the replica ran slower than planned and a deadline passed (`_give_up_missed`)."""
        self.num_demoted = 0
        """Admitted requests that lost their guarantee since the start (`demoted` keeps the
        latest of them)."""
        self.promoted: deque[str] = deque(maxlen=HISTORY)
        """Best-effort requests guaranteed later, when a replan found room (`_promotable`)."""
        self.num_promoted = 0
        """Best-effort requests guaranteed later since the start (`promoted` keeps the latest
        of them)."""
        self.budget: BatchBudget | None = None
        self.last_admission: AdmissionResult | None = None
        self.verdicts: dict[str, bool] = {}
        """Admission verdict of the requests that went through the DP (True: admitted), the
        latest HISTORY of them."""
        self._work: dict[str, SloWork] = {}
        self._reserved_blocks = 0
        self._stretched = True
        """Whether the last plan was free to offer speculating budgets (`_may_stretch`)."""

    @property
    def unreserved_blocks(self) -> int:
        """KV blocks no admitted request has reserved (best-effort work may borrow them)."""
        return self.queues.budget.num_blocks - self._reserved_blocks

    @property
    def admitted(self) -> dict[str, float]:
        """Admitted request -> the TPOT the current plan holds it to."""
        return {rid: work.tpot_s for rid, work in self._work.items()}

    # -- requests in ---------------------------------------------------------------------------

    def add_request(self, request: Request, now: float, cached: int = 0) -> None:
        """Queue for the next admission decision (best-effort requests skip it)."""
        self.queues.add(request, cached)
        if request.tier is Tier.BEST_EFFORT:
            self.best_effort.append(request.request_id)
        else:
            self.pending.append(request.request_id)
            self.invocation.note_new()

    def add_admitted(self, request: Request, now: float, cached: int = 0) -> None:
        """Bind a request a controller admitted with `plan_admission` on this replica (with
        the same `cached` tokens it was planned with)."""
        if request.tier is not Tier.SLO:
            raise ValueError(f"request {request.request_id!r} is best-effort; it has no SLO")
        self.queues.add(request, cached)
        self._admit(request.request_id, now)
        self.invocation.note_new()

    def add_best_effort(self, request: Request, now: float, cached: int = 0) -> None:
        """Serve a request (e.g. declined by every replica) from leftovers, without a promise."""
        self.queues.add(request, cached)
        self.best_effort.append(request.request_id)

    def abort_request(self, request_id: str) -> None:
        self.queues.abort(request_id)
        self._forget(request_id)
        self._forget_estimates(request_id)

    def _forget_estimates(self, request_id: str) -> None:
        """An ended request leaves the per-request estimates of LAPS-SD and GOODSPEED
        (`_forget` does not: a demoted request keeps its history), also one aborted while
        its step ran, whose outcome they have just folded in."""
        if self.laps is not None:
            self.laps.forget(request_id)
        if self.goodspeed is not None:
            self.goodspeed.forget(request_id)

    def _admit(self, request_id: str, now: float) -> None:
        state = self.queues.states[request_id]
        factor = self.config.invocation.behind_tpot_factor
        reserve = min(
            max(self._reservation(state.request), state.num_known_tokens + self._step_growth()),
            peak_tokens(state.request),
        )
        work = SloWork.of(state, now, self.budget, factor, 0)
        self._work[request_id] = work
        self._resize(work, reserve)

    def admission_blocks(self, request: Request) -> int:
        """KV blocks admitting `request` would reserve now."""
        return self.queues.budget.blocks_for(self._reservation(request))

    def _reservation(self, request: Request) -> int:
        """KV slots a request reserves when admitted."""
        if self.lengths is None:
            return peak_tokens(request)
        return self.lengths.initial_tokens(request)

    def _step_growth(self) -> int:
        """Most slots one decode step adds (the token and its drafts)."""
        return 1 + (self.config.spec.max_spec_tokens if self.config.spec is not None else 0)

    def _resize(self, work: SloWork, tokens: int) -> None:
        """Set a request's reservation to `tokens` (0 releases it)."""
        blocks_for = self.queues.budget.blocks_for
        self._reserved_blocks += blocks_for(tokens) - blocks_for(work.reserve_tokens)
        work.reserve_tokens = tokens

    def _forget(self, request_id: str) -> None:
        work = self._work.pop(request_id, None)
        if work is not None:
            self._resize(work, 0)
        if request_id in self.pending:
            self.pending.remove(request_id)
        if request_id in self.best_effort:
            self.best_effort.remove(request_id)

    # -- planning ------------------------------------------------------------------------------

    def plan_admission(
        self, new: Sequence[Request], now: float, cached: Mapping[str, int] | None = None
    ) -> AdmissionResult:
        """Which of `new` this replica can guarantee next to its admitted requests, each
        prefill priced without the leading prompt tokens `cached` says the replica's prefix
        cache holds (none for a request it does not name).

        Pure: nothing changes until the caller binds the admitted ones. Best-effort requests
        in `new` are always declined. The budget options (see `plan_budgets`) are solved in
        order and the one keeping the running requests on time with the most admitted value
        wins; the solving stops at an option that keeps them all on time and admits every
        candidate (most replans: a second solve would cost as much and could only tie).
        Batches are planned from the end of the batch in flight, if any: a request admitted
        now can ride no earlier batch. The options are sized for the candidates too, so
        their batches may be too slow for a running request promised on a budget without
        them: if none keeps every running request on time, the options for the running
        requests alone are solved as well (as open to speculating budgets: the candidates
        they decline wait for their prompts), and the better ranked wins (every candidate
        is declined on either)."""
        slo_new = [r for r in new if r.tier is Tier.SLO]
        running = self._running(now)
        stretch = self._may_stretch(bool(slo_new))
        result = self._best_option(self._problems(slo_new, now, cached or {}, running, stretch))
        if slo_new and not result.keeps_running:
            alone = self._best_option(self._problems([], now, {}, running, stretch))
            if alone.rank() > result.rank():
                result = replace(alone, declined=result.declined)
        if len(slo_new) == len(new):
            return result
        best_effort = tuple(r.request_id for r in new if r.tier is not Tier.SLO)
        return replace(result, declined=result.declined + best_effort)

    def _best_option(self, problems: Iterable[AdmissionProblem]) -> AdmissionResult:
        """The DP's verdict on the best of the budget options `problems` (in order)."""
        results = []
        for problem in problems:
            solved = solve_admission(problem, self.config.max_dp_candidates)
            results.append(solved)
            if solved.keeps_running and not solved.declined:
                break  # no later option can do better, and ties keep the first
        return max(results, key=AdmissionResult.rank)

    def admission_problems(
        self, slo_new: Sequence[Request], now: float, cached: Mapping[str, int] | None = None
    ) -> Iterator[AdmissionProblem]:
        """The admission DP's problem on each budget option, in the order `plan_admission`
        solves them first, for the SLO requests `slo_new` (see there for `cached`); built
        as asked for, since the solving mostly stops at the first."""
        running = self._running(now)
        return self._problems(slo_new, now, cached or {}, running, self._may_stretch(bool(slo_new)))

    def _problems(
        self,
        slo_new: Sequence[Request],
        now: float,
        cached: Mapping[str, int],
        running: tuple[RunningDecoders, tuple[RunningPrefill, ...]],
        stretch: bool,
    ) -> Iterator[AdmissionProblem]:
        """`admission_problems` on the running requests `running`, with speculating budgets
        among the options if `stretch`."""
        decoders, prefills = running
        cache = self.queues.budget
        candidates = tuple(
            _candidate(r, cache.blocks_for(self._reservation(r)), cached.get(r.request_id, 0))
            for r in slo_new
        )
        start = max(now, self._busy_until)
        for budget in self._budgets(decoders, prefills, slo_new, start, stretch):
            yield AdmissionProblem(
                now=start,
                budget=budget,
                candidates=candidates,
                prefills=prefills,
                decoders=decoders,
                free_blocks=cache.num_blocks - self._reserved_blocks,
                memory_units=self.config.memory_units,
                perf=self.perf,
            )

    def _running(self, now: float) -> tuple[RunningDecoders, tuple[RunningPrefill, ...]]:
        """The admitted requests as the DP forces them in; decoders behind their line are
        held to a tighter TPOT (InvocationConfig.behind_tpot_factor)."""
        works = list(self._work.values())
        decoding = [w for w in works if w.decoding]
        deadlines = np.array([w.token_deadline_s for w in decoding], dtype=float)
        tpots = np.array([w.base_tpot_s for w in decoding], dtype=float)
        if self.budget is not None:
            behind = lags(deadlines, now, self.budget.period_s)
            tpots = np.where(behind, tpots * self.config.invocation.behind_tpot_factor, tpots)
        remaining = np.array([w.state.remaining_output for w in decoding], dtype=float)
        early = np.array([w.early_tokens for w in decoding], dtype=float)
        chains = tuple(w.chain for w in decoding)
        prefills = tuple(
            RunningPrefill(
                prefill_tokens=w.state.num_uncomputed,
                deadline_s=w.token_deadline_s,
                tpot_s=w.tpot_s,
                decode_tokens=w.state.remaining_output - 1,
                early_tokens=w.early_tokens,
                chain=w.chain,
            )
            for w in works
            if not w.decoding
        )
        return RunningDecoders(deadlines, tpots, remaining, early, chains), prefills

    def _budgets(
        self,
        decoders: RunningDecoders,
        prefills: Sequence[RunningPrefill],
        slo_new: Sequence[Request],
        start: float,
        stretch: bool,
    ) -> tuple[BatchBudget, ...]:
        """Budget options for the running requests plus all of `slo_new` with batches from
        `start`, speculating ones among them if `stretch`. Best-effort work is not counted:
        it only fills time a batch has left (`form_batch`), so it cannot shrink what the
        admission DP may promise.

        Urgent options count only the decoders that can fall due within the plan's horizon
        (the last prompt deadline plus two of the tightest TPOT, past the life of a budget
        between replans): a decoder far ahead of its line skips a short batch it does not
        fit, so a tight-TTFT prompt can be promised a batch of its own beside long decodes."""
        loads = Counter(decoders.tpot_s.tolist())
        loads.update(p.tpot_s for p in prefills)
        loads.update(remaining_tpot(r, 1) for r in slo_new)
        works = list(self._work.values())
        tightest = min(loads, default=None)
        main = self._worst_batch(works, slo_new, tightest)
        deadlines = [prefill_deadline(r) for r in slo_new] + [p.deadline_s for p in prefills]
        horizon = max([start, *deadlines]) + 2 * (tightest or 0.0)
        near = [w for w in works if not w.decoding or w.urgency_s < horizon]
        urgent = self._worst_batch(near, slo_new, tightest)
        spec = self.config.spec if stretch else None
        return plan_budgets(
            self.perf,
            [TierLoad(float(tpot), int(n)) for tpot, n in sorted(loads.items())],
            speculating_batch=self._worst_batch(works, slo_new, None) if spec else None,
            num_requests=main.num_requests,
            max_context=main.max_context,
            kv_tokens=main.kv_tokens,
            idle_period_s=self.config.idle_period_s,
            spec=spec,
            acceptance=self.acceptance.value if self.acceptance is not None else 0.0,
            min_period_s=main.min_period_s,
            urgent_periods_s=(
                *_urgent_periods(decoders, prefills, slo_new, start, urgent.min_period_s),
                # The period the running requests were last planned on: what kept them
                # feasible then is still offered (an urgent period is otherwise recomputed
                # from the most urgent request, and a slightly longer one may miss).
                *(() if self.budget is None else (self.budget.period_s,)),
            ),
            urgent_batch=urgent,
        )

    def _worst_batch(
        self, works: Sequence[SloWork], slo_new: Sequence[Request], tightest: float | None
    ) -> WorstBatch:
        """The batch of `works` and `slo_new` at their longest (see `budget.capacity`).

        With `tightest` (the period of an autoregressive budget), a decoder of a looser TPOT
        is due in only tightest / tpot of the batches, so it counts as that fraction of a
        request and of its KV, as `BatchBudget.cost_per_batch` counts its tokens; None counts
        every decoder in every batch (speculating budgets serve them all each batch). No query
        token attends beyond its request's reservation, which grows before a step could
        outrun it (`_extend_reservations`)."""
        reservations = [self._reservation(r) for r in slo_new]
        max_context = max([1, *(w.reserve_tokens for w in works), *reservations])
        shares = [
            min(1.0, tightest / w.tpot_s) if tightest is not None and w.decoding else 1.0
            for w in works
        ]
        # A batch cannot read more KV than the cache holds, however many requests it counts.
        cache = self.queues.budget
        kv_tokens = min(
            math.ceil(sum(f * w.reserve_tokens for f, w in zip(shares, works, strict=True)))
            + sum(reservations),
            cache.num_blocks * cache.block_size,
        )
        running = math.ceil(sum(shares) - 1e-9)
        floor = (
            self.perf.predict_aggregate(
                num_tokens=running,
                num_requests=running + len(slo_new),
                attn_tokens=running * max_context,
                kv_tokens=kv_tokens + running,
            )
            if running
            else 0.0
        )
        return WorstBatch(running + len(slo_new), max_context, kv_tokens, floor)

    def _may_stretch(self, new_prompts: bool = False) -> bool:
        """Whether speculating budgets, whose period stretches to tpot x E(s), may be offered:
        with no prompt waiting (`new_prompts`: new SLO requests are about to be planned) they
        delay no prefill, else only while KV is scarce enough that faster decoding (KV freed
        sooner) pays for the longer batches (`SpecConfig.stretch_kv_fraction` says why)."""
        spec = self.config.spec
        if spec is None:
            return False
        if not new_prompts and not self._prompts_waiting():
            return True
        return self._reserved_blocks >= spec.stretch_kv_fraction * self.queues.budget.num_blocks

    def _prompts_waiting(self) -> bool:
        """An admitted or best-effort request has prompt tokens left to compute: best-effort
        prefills fill a stretched batch's leftover too, and a request arriving waits for it."""
        states = self.queues.states
        return any(not w.decoding for w in self._work.values()) or any(
            not states[rid].is_decoding for rid in self.best_effort
        )

    def _ride_spec_tokens(self) -> int:
        """Drafts a decoder ahead of its line may speculate beyond the budget's lengths: as
        many as the config allows while speculating budgets may be offered (`_may_stretch`:
        the longer batch then delays no prompt, or KV binds and decode speed frees it)."""
        spec = self.config.spec
        if spec is None or self.acceptance is None or not self._may_stretch():
            return 0
        return spec.max_spec_tokens

    def _promotable(self, now: float) -> list[Request]:
        """Best-effort SLO requests that have no token yet and could still have their first
        one on time, most urgent first, at most one DP group: offered to every replan's DP,
        so a request declined in a burst is guaranteed as soon as the plan has room for it
        (batches run faster than the DP's worst case, and the burst's other prompts finish)."""
        waiting = [
            state.request
            for state in (self.queues.states[rid] for rid in self.best_effort)
            if state.request.tier is Tier.SLO
            and not state.is_decoding
            and not state.output_token_ids
            and prefill_deadline(state.request) > now
        ]
        waiting.sort(key=prefill_deadline)
        out: list[Request] = []
        for request in waiting:
            if len(out) == self.config.max_dp_candidates:
                break
            if prefill_deadline(request) > now + self._alone_s(request):
                out.append(request)
        return out

    def _alone_s(self, request: Request) -> float:
        """The prompt's time as a batch of its own: a request due sooner cannot be on time."""
        return self.perf.predict_aggregate(
            num_tokens=request.prompt_len,
            num_requests=1,
            attn_tokens=attention_pairs(request.prompt_len, 0),
            kv_tokens=request.prompt_len,
        )

    def undecided(self, now: float) -> tuple[list[Request], list[Request], dict[str, int]]:
        """What a replan at `now` decides on: the new requests, the best-effort ones it may
        still promote, and the prompt tokens the new ones start from (a prefix cache's)."""
        states = self.queues.states
        new = [states[rid].request for rid in self.pending]
        cached = {rid: states[rid].num_computed_tokens for rid in self.pending}
        return new, self._promotable(now), cached

    def _replan(self, now: float) -> BatchBudget:
        new, promotable, cached = self.undecided(now)
        result = self.plan_admission(new + promotable, now, cached)
        self.budget = result.budget
        factor = self.config.invocation.behind_tpot_factor
        for work in self._work.values():
            work.refresh(now, result.budget, factor)
        for request in new:
            rid = request.request_id
            _remember(self.verdicts, rid, result.is_admitted(rid))
            if result.is_admitted(rid):
                self._admit(rid, now)
            else:
                self.best_effort.append(rid)
        for request in promotable:
            rid = request.request_id
            if result.is_admitted(rid):
                self.best_effort.remove(rid)
                self._admit(rid, now)
                self.promoted.append(rid)
                self.num_promoted += 1
        self.pending.clear()
        self.last_admission = result
        self.invocation.planned(now)
        self._stretched = self._may_stretch()
        return result.budget

    def schedule(self, now: float) -> BatchPlan | None:
        budget = self.budget
        if (
            budget is None
            or self.invocation.due(now)
            # The last prompt is done: speculating budgets are open again (the first verify
            # right after a prefill, rather than at the next timed replan).
            or (not self._stretched and self._may_stretch())
        ):
            budget = self._replan(now)
        plan = form_batch(
            now,
            budget,
            self.perf,
            list(self._work.values()),
            self._best_effort_order(now),
            self.queues,
            self._reserved_blocks,
            self.config.max_best_effort_requests,
            self.config.best_effort_stretch,
            self._ride_spec_tokens(),
        )
        if plan is not None and self.goodspeed is not None:
            states = self.queues.states
            remaining = {
                e.request_id: states[e.request_id].remaining_output
                for e in plan.entries
                if isinstance(e, DecodeStep) and e.num_spec_tokens
            }
            plan = self.goodspeed.split(plan, remaining, self.admitted)
        if plan is not None:
            self._busy_until = now + self.perf.predict(self.shape(plan))
        return plan

    def _best_effort_order(self, now: float) -> list[RequestState]:
        """Best-effort requests that can still meet their next deadline first, earliest
        deadline first; the ones already late (or without an SLO) after them, oldest first
        or in LAPS-SD's order (`PlannerConfig.laps`)."""
        timely: list[tuple[float, RequestState]] = []
        rest: list[RequestState] = []
        for rid in self.best_effort:
            state = self.queues.states[rid]
            request = state.request
            if request.slo is not None:
                due = token_deadline(request, len(state.output_token_ids))
                if due >= now:
                    timely.append((due, state))
                    continue
            rest.append(state)
        timely.sort(key=lambda item: item[0])
        # By arrival, not by when each joined the tier: a request that gave its guarantee up
        # joined last, though it came before most.
        rest.sort(key=lambda state: state.request.arrival_time)
        if self.laps is not None:
            rest = self.laps.order(rest, self._remaining_estimate, now)
        return [state for _, state in timely] + rest

    def _remaining_estimate(self, state: RequestState) -> int:
        """Output tokens a request is expected still to produce (the scheduler never sees
        the true length): the mean residual of the observed output lengths, else up to
        max_tokens."""
        produced = len(state.output_token_ids)
        if self.lengths is None:
            return max(1, state.request.sampling.max_tokens - produced)
        return self.lengths.expected_remaining(state.request, produced)

    def shape(self, plan: BatchPlan) -> BatchShape:
        """The plan as the perf model sees it."""
        states = self.queues.states
        return BatchShape.of_plan(plan, lambda rid: states[rid].num_computed_tokens, self.perf.tp)

    # -- outcomes ------------------------------------------------------------------------------

    def update_from_outcome(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        self._busy_until = now
        finished = self.queues.apply(plan, outcome, now)
        if self.laps is not None:
            self.laps.observe(plan, outcome, now)
        if self.goodspeed is not None:
            self.goodspeed.observe(plan, outcome)
        for entry in plan.entries:
            if entry.request_id not in self.queues.states:  # finished, or aborted meanwhile
                self._forget_estimates(entry.request_id)
        for state in finished:
            self._forget(state.request_id)
            if self.lengths is not None:
                self.lengths.observe(state.request, len(state.output_token_ids))
        self.invocation.note_finished(len(finished))
        if self.lengths is not None:
            self._extend_reservations(outcome)
        if self.acceptance is not None:
            drafting = [o for o in outcome.outcomes if o.num_draft_tokens > 0]
            self.acceptance.observe(
                sum(outcome_judged(o) for o in drafting),
                sum(o.num_accepted_tokens for o in drafting),
            )
        self._give_up_missed(outcome, now)
        self._refresh(outcome, now)
        if self.budget is None:  # a mirror rebuilt since its last plan
            return
        period = self.budget.period_s
        self.invocation.note_batch(period, outcome.total_s)
        self.invocation.note_lagging(
            {
                rid
                for rid, w in self._work.items()
                if w.decoding and lags(w.token_deadline_s, now, period)
            }
        )

    def _refresh(self, outcome: BatchOutcome, now: float) -> None:
        """The admitted requests the outcome moved on, as the plan holds them now."""
        factor = self.config.invocation.behind_tpot_factor
        for result in outcome.outcomes:
            work = self._work.get(result.request_id)
            if work is not None:
                work.refresh(now, self.budget, factor)

    def _give_up_missed(self, outcome: BatchOutcome, now: float) -> None:
        """Admitted requests that already missed a deadline (a token out late, or a prompt
        not done by its first token's deadline) become best-effort: nothing can make them
        attain now, and keeping them first lets one late batch make every later request late.

        Only a replica slower than its plan misses (the DP's guarantee holds on the
        profile's speed); live, on cores shared with the serving stack, the admitted backlog
        otherwise grew until every request missed (loadgen/RESULTS.md)."""
        missed = [
            result.request_id
            for result in outcome.outcomes
            if result.new_token_ids
            and result.request_id in self._work
            and _first_new_late(self._work[result.request_id].state, result, now)
        ]
        missed += [
            rid
            for rid, work in self._work.items()
            if not work.state.output_token_ids and prefill_deadline(work.state.request) < now
        ]
        for rid in dict.fromkeys(missed):
            self._demote(rid)

    def restore(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        """The replica's progress before this planner saw it. Its tokens came earlier, at
        times the snapshot does not keep, so nothing is judged late here: judged at `now`,
        every admitted request with a token lost its guarantee at every rebuild. The
        replica's next report is judged as any (a prompt past due then too: its token may
        have come on time after the snapshot, in a report folded after the rebuild)."""
        # A snapshot holds no finished request; one the replay ended would leave the plan.
        for state in self.queues.apply(plan, outcome, now):
            self._forget(state.request_id)
        self._refresh(outcome, now)
        if self.lengths is not None:
            self._extend_reservations(outcome)

    def _extend_reservations(self, outcome: BatchOutcome) -> None:
        """Grow the reservation of every request whose next step could outrun it. If the
        reservations no longer fit the cache, the newest admitted requests first give up the
        headroom beyond their next step, and only if that is not enough do they become
        best-effort (their memory may be reclaimed) until the rest fit.

        Why headroom first: a demoted request waits behind every admitted one and, with the
        cache full, is preempted; it then misses its SLO by minutes (simulated chatbot, A100
        OPT-7B, 5.25 req/s: 16 of 900 requests, every admitted one that missed), while what
        the reservations overran was mostly headroom (loadgen/RESULTS.md)."""
        assert self.lengths is not None
        for result in outcome.outcomes:
            work = self._work.get(result.request_id)
            if work is None:
                continue
            tokens = work.reserve_tokens
            while tokens < self._next_step_tokens(work):
                tokens = self.lengths.extended_tokens(work.state.request, tokens)
            if tokens != work.reserve_tokens:
                self._resize(work, tokens)
        blocks = self.queues.budget.num_blocks
        for work in reversed(self._work.values()):
            if self._reserved_blocks <= blocks:
                break
            self._resize(work, min(work.reserve_tokens, self._next_step_tokens(work)))
        while self._reserved_blocks > blocks:
            self._demote(next(reversed(self._work)))

    def _demote(self, request_id: str) -> None:
        self._forget(request_id)
        self.best_effort.append(request_id)
        self.demoted.append(request_id)
        self.num_demoted += 1

    def _next_step_tokens(self, work: SloWork) -> int:
        """KV slots the request holds after its next step at the longest."""
        return min(work.state.num_known_tokens - 1 + self._step_growth(), work.peak_tokens)

    def has_unfinished(self) -> bool:
        return self.queues.has_unfinished()


def _remember(history: dict[str, bool], key: str, value: bool) -> None:
    history[key] = value
    if len(history) > HISTORY:
        del history[next(iter(history))]


def _first_new_late(state: RequestState, result: RequestOutcome, now: float) -> bool:
    """Whether the first token `result` delivered (at `now`) was past its deadline."""
    first = len(state.output_token_ids) - len(result.new_token_ids)
    return token_deadline(state.request, first) < now - _LATE_EPS_S


def _urgent_periods(
    decoders: RunningDecoders,
    prefills: Sequence[RunningPrefill],
    slo_new: Sequence[Request],
    start: float,
    floor: float,
) -> tuple[float, ...]:
    """The longest period keeping the most urgent new request on time, and the one keeping
    the most urgent admitted request on time (each only if at least `floor`).

    A request admitted with batches that short (its first token due sooner than a TPOT away)
    needs them until its first token, and any tokens a stage starting early crowds together,
    are out; and after that, batches no longer than the time left to its next token, or the
    first longer batch makes it late."""
    new = np.array(
        [
            chain_period(
                upcoming_deadlines(r, 0) if early_stage_starts(r, 0) else (prefill_deadline(r),),
                start,
            )
            for r in slo_new
        ]
    )
    running = np.concatenate(
        [
            [chain_period(p.chain or (p.deadline_s,), start) for p in prefills],
            [chain_period(chain, start) for chain in decoders.chains if chain],
            decoders.next_deadline_s - start,
        ]
    )
    return tuple(
        float(needs[needs >= floor].min()) for needs in (new, running) if np.any(needs >= floor)
    )


def _candidate(request: Request, blocks: int, cached: int) -> Candidate:
    early = early_stage_starts(request, 0)
    return Candidate(
        request_id=request.request_id,
        prefill_tokens=request.prompt_len - cached,
        deadline_s=prefill_deadline(request),
        tpot_s=remaining_tpot(request, 1),
        decode_tokens=request.sampling.max_tokens - 1,
        blocks=blocks,
        value=request.value,
        early_tokens=early,
        chain=upcoming_deadlines(request, 0) if early else (),
    )
