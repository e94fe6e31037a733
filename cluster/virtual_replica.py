"""The controller's mirror of one replica: its scheduler fed with its reports.

The scheduler is SLOs-Serve's planner, whose admission the controller asks for, or a baseline
(vllm, sarathi) that takes every request it is given: the config's type says which.

The replica is authoritative. The mirror folds in every executed step, in order: a report past
a gap waits (ReportFit.AHEAD) for those before it, which Ray may deliver later, since it keeps
no order among an async actor's calls. A report that never comes (a failed step sends none) or
one from a restarted replica means the mirror is wrong, and it is rebuilt from the replica's
snapshot instead of being patched.

With `calibrate` the planner plans with a calibrated perf model: every executed step's
measured seconds are fed back against the profile's prediction for that step's shape, so a
replica slower than its profile (shared cores, another tenant) is planned, and admits, as slow
as it is. Off by default (cluster.config.ClusterConfig.calibrate says why). The simulator's
mirrors do not calibrate: with `SimConfig.replica_slowdown` they plan with the profile while
its replicas run slower, as a live cluster with calibration off does.

The mirror may keep two pictures of the replica's prefix cache (replica.kv_cache.PrefixPicture),
each fed the prompt and output of every request that ends here, or whose client stops reading
after its first token:
- with `track_prefixes`, for the prefix first hop (cluster.routing), `prefixes` is also fed the
  prompts bound here, as they will soon be computed: a conversation's next turn, or traffic
  sharing a system prompt, goes where its prefix will be;
- with `credit_prefixes`, `computed` is fed what the replica caches as it computes it (each
  prefill chunk's prefix, a preempted request's blocks), and a request bound here starts from
  the prefix it pictures: admission prices, and the plans feed, only the rest of the prompt,
  as vLLM's scheduler counts a prefix-cache hit computed.
  A picture may promise a prefix the replica no longer has (evicted since): the replica then
  computes what it lacks, the first token may come later than planned, and
  `credit_missed_tokens` counts those tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from enum import StrEnum
from itertools import islice

from cluster.api import ReplicaStatus
from cluster.messages import ReplicaSnapshot, StepReport
from replica.batch import (
    BatchOutcome,
    BatchPlan,
    DecodeStep,
    FinishReason,
    PrefillChunk,
    RequestOutcome,
)
from replica.kv_cache import PrefixPicture
from replica.perf_calibration import CalibratedPerfModel, Calibration
from replica.perf_model import BatchShape, PerfModel
from replica.planner.admission import AdmissionResult
from replica.planner.base import CacheBudget, RequestState, leading_tokens
from replica.planner.config import PlannerConfig
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.slos import SlosScheduler
from replica.planner.vllm import VllmConfig, VllmScheduler
from replica.request import Request

ReplicaScheduler = SlosScheduler | VllmScheduler | SarathiScheduler
SchedulerConfig = PlannerConfig | VllmConfig | SarathiConfig


class ReportFit(StrEnum):
    APPLIED = "applied"
    STALE = "stale"
    """Already reflected (e.g. in the snapshot the mirror was rebuilt from): ignored."""
    AHEAD = "ahead"
    """Past a gap: the reports before it have not come (yet), nothing is folded."""
    RESYNC = "resync"
    """Another incarnation: the mirror must be rebuilt from a snapshot."""


class VirtualReplica:
    """Scheduler + perf model + the requests one replica holds."""

    def __init__(
        self,
        index: int,
        perf: PerfModel,
        cache: CacheBudget,
        config: SchedulerConfig | None = None,
        calibrate: bool = False,
        track_prefixes: bool = False,
        credit_prefixes: bool = False,
    ) -> None:
        self.index = index
        self.perf = CalibratedPerfModel(perf, Calibration()) if calibrate else None
        """The slos planner's model; None: it plans with the profile as is. Kept across
        rebuilds: the replica's speed outlives its incarnation."""
        self.profile = perf
        self.cache = cache
        self.config = config or PlannerConfig()
        self.alive = True
        self.incarnation = ""
        self.seq = 0
        self.held: dict[str, Request] = {}
        self._bound_admitted: set[str] = set()
        """A baseline's requests bound admitted (its grades never change)."""
        self.regraded: dict[str, bool] = {}
        """Guarantees the planner changed since the replica was last told (True: promoted,
        False: demoted), sent with its next plan (`take_regraded`): its snapshot then holds
        them, so a mirror rebuilt from it neither promotes nor demotes a request again. One
        not sent yet when the mirror is rebuilt (no plan since; its request still being
        handed over) is lost with it: the rebuilt mirror starts from the replica's grade and
        may decide again (counted again)."""
        self.preempted_tokens = 0
        """KV tokens the replica's preemptions dropped (work it computes again when the
        requests resume), counted as their steps are folded in."""
        self.scheduler = self._new_scheduler()
        self.track_prefixes = track_prefixes
        self.credit_prefixes = credit_prefixes
        self.prefixes, self.computed = self._new_pictures()
        self.credits: dict[str, int] = {}
        """Requests bound with a credit whose prefill has not begun: the tokens credited."""
        self.credited_tokens = 0
        """Prompt tokens credited as cached when their requests were bound, counted when the
        prefill began: a credit withdrawn before (the request moved, aborted) was never
        looked up, and counted at the bind it made the credited tokens exceed the hits."""
        self.credit_missed_tokens = 0
        """Of those, the tokens the replica did not find cached when the prefill began."""
        self._pictured = ""
        """The incarnation whose cache the pictures are of: a replica back up after a missed
        health check (marked dead, its mirror reset) still has its cache."""

    def _new_scheduler(self) -> ReplicaScheduler:
        if isinstance(self.config, VllmConfig):
            return VllmScheduler(self.cache, self.config)
        if isinstance(self.config, SarathiConfig):
            return SarathiScheduler(self.cache, self.config)
        return SlosScheduler(self.perf or self.profile, self.cache, self.config)

    def _new_pictures(self) -> tuple[PrefixPicture | None, PrefixPicture | None]:
        blocks, size = self.cache.num_blocks, self.cache.block_size
        return (
            PrefixPicture(blocks, size) if self.track_prefixes else None,
            PrefixPicture(blocks, size) if self.credit_prefixes else None,
        )

    def cached_prefix(self, request: Request) -> int:
        """Leading prompt tokens the replica likely has cached or soon will, at most what it
        would start the request from (replica.kv_cache.prefix_limit; 0 without tracking)."""
        if self.prefixes is None:
            return 0
        return self.prefixes.cached_prompt(request.prompt_token_ids)

    def prefix_credit(self, request: Request) -> int:
        """Leading prompt tokens the scheduler counts computed when `request` is bound here
        (none without `credit_prefixes`, nor for a request that asked for prompt
        log-probabilities: the replica computes its whole prompt)."""
        if self.computed is None or request.sampling.prompt_logprobs is not None:
            return 0
        return self.computed.cached_prompt(request.prompt_token_ids)

    @property
    def plans_admission(self) -> bool:
        """Whether the controller asks this replica's planner before binding a request
        (False: a baseline, which takes every request it is given)."""
        return isinstance(self.scheduler, SlosScheduler)

    @property
    def num_demoted(self) -> int:
        """Admitted requests this incarnation's planner gave up (see SlosScheduler.demoted)."""
        return self.scheduler.num_demoted if isinstance(self.scheduler, SlosScheduler) else 0

    @property
    def num_promoted(self) -> int:
        """Promotions this incarnation's planner made (see SlosScheduler.promoted)."""
        return self.scheduler.num_promoted if isinstance(self.scheduler, SlosScheduler) else 0

    @property
    def admitted(self) -> AbstractSet[str]:
        """The requests guaranteed now: the slos planner's (bound admitted or promoted since,
        less those demoted), a baseline's those bound admitted."""
        if isinstance(self.scheduler, SlosScheduler):
            return self.scheduler.admitted.keys()
        return self._bound_admitted

    @property
    def load(self) -> float:
        """Requests held: the least-load first hop's signal."""
        return float(len(self.held))

    def unstarted_best_effort(self, handing: AbstractSet[str]) -> list[str]:
        """The best-effort requests waiting for their first step, in the order bound, but
        those in `handing` (still being handed to the replica). One bound with a prefix
        credit starts from it: computed so far, its prefill not begun (`credits`)."""
        states = self.scheduler.queues.states
        guaranteed = self.admitted
        return [
            rid
            for rid in self.scheduler.queues.waiting
            if rid not in guaranteed
            and rid not in handing
            and not states[rid].output_token_ids
            and states[rid].num_computed_tokens == self.credits.get(rid, 0)
        ]

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def plan_admission(self, requests: Sequence[Request], now: float) -> AdmissionResult:
        if not isinstance(self.scheduler, SlosScheduler):
            raise TypeError(f"replica {self.index} runs a baseline; it plans no admission")
        credits = {r.request_id: self.prefix_credit(r) for r in requests}
        return self.scheduler.plan_admission(requests, now, credits)

    def admit(self, request: Request, now: float) -> None:
        self._bind(request, now, True, self.prefix_credit(request))

    def add_best_effort(self, request: Request, now: float) -> None:
        self._bind(request, now, False, self.prefix_credit(request))

    def _bind(self, request: Request, now: float, admitted: bool, credit: int) -> None:
        rid = request.request_id
        if not isinstance(self.scheduler, SlosScheduler):
            self.scheduler.add_request(request, now, credit)
            if admitted:
                self._bound_admitted.add(rid)
        elif admitted:
            self.scheduler.add_admitted(request, now, credit)
        else:
            self.scheduler.add_best_effort(request, now, credit)
        self.held[rid] = request
        if self.prefixes is not None:
            self.prefixes.remember(request.prompt_token_ids)
        if credit and self.computed is not None:  # a credited prefix is taken last
            self.computed.touch(request.prompt_token_ids)
        if credit:
            self.credits[rid] = credit

    def abort(self, request_id: str) -> bool:
        """Forget a request; False when this replica does not hold it. What it computed stays
        cached (a client that read what it wanted leaves its history), as far as the mirror
        has seen it."""
        if request_id not in self.held:
            return False
        state = self.scheduler.queues.states.get(request_id)
        if state is not None and self._pictures():
            self._remember_history(_known(state, state.num_computed_tokens))
        self._drop(request_id)
        self.scheduler.abort_request(request_id)
        return True

    def _drop(self, request_id: str) -> None:
        """Forget a request that ended here."""
        self.held.pop(request_id, None)
        self._bound_admitted.discard(request_id)
        self.regraded.pop(request_id, None)
        self.credits.pop(request_id, None)

    def next_plan(self, now: float) -> BatchPlan | None:
        """The replica's next plan; the requests its replan promoted are admitted from now
        on, also when the batch then cannot be formed."""
        promoted = self.num_promoted
        try:
            return self.scheduler.schedule(now)
        finally:
            self._regrade(promoted, self.num_demoted)

    def take_regraded(self, unheld: Collection[str] = ()) -> dict[str, bool]:
        """The guarantee changes to send the replica with a plan (see `regraded`), but for
        the requests in `unheld`: not handed to the replica yet, it would not know them."""
        if not self.regraded:  # as after nearly every step
            return {}
        taken = {rid: v for rid, v in self.regraded.items() if rid not in unheld}
        self.regraded = {rid: v for rid, v in self.regraded.items() if rid in unheld}
        return taken

    def _regrade(self, promoted: int, demoted: int) -> None:
        """Note the planner's promotions and demotions since it had made `promoted` and
        `demoted` of them, for the replica."""
        if not isinstance(self.scheduler, SlosScheduler):
            return
        scheduler = self.scheduler
        for rid in _latest(scheduler.promoted, scheduler.num_promoted - promoted):
            self.regraded[rid] = True
        for rid in _latest(scheduler.demoted, scheduler.num_demoted - demoted):
            self.regraded[rid] = False

    def apply(self, report: StepReport) -> ReportFit:
        """Fold an executed step in, if it is the next one of the incarnation mirrored."""
        if report.incarnation != self.incarnation:
            return ReportFit.RESYNC
        if report.seq > self.seq + 1:
            return ReportFit.AHEAD
        if report.seq <= self.seq:
            return ReportFit.STALE
        self.seq = report.seq
        self._calibrate(report)
        states = self.scheduler.queues.states
        self.preempted_tokens += sum(
            states[rid].num_computed_tokens for rid in report.plan.preempt if rid in states
        )
        self._check_credits(report)
        self._remember_computed(report)
        demoted = self.num_demoted
        self.scheduler.update_from_outcome(report.plan, report.outcome, report.time)
        self._regrade(self.num_promoted, demoted)
        for result in report.outcome.outcomes:
            if result.finished:
                self._drop(result.request_id)
        return ReportFit.APPLIED

    def _check_credits(self, report: StepReport) -> None:
        """Count the credited tokens the replica did not find cached, from the step that
        began the requests' prefills (what it computed, less the chunk it ran)."""
        if not self.credits:
            return
        after = {o.request_id: o.num_computed_tokens for o in report.outcome.outcomes}
        for entry in report.plan.entries:
            rid = entry.request_id
            if rid in self.credits and isinstance(entry, PrefillChunk) and rid in after:
                found = after[rid] - entry.num_tokens
                credit = self.credits.pop(rid)
                self.credited_tokens += credit
                self.credit_missed_tokens += max(0, credit - found)

    def _remember_computed(self, report: StepReport) -> None:
        """What the step left cached, as the replica registers it: what a preempted request
        had computed (its blocks stay cached), the history of a request that ended (the one
        a chat or an agent sends back next turn), then what each prefill has computed so far
        (`computed` only: `prefixes` has a prompt since it was bound). The simulated replica
        (PerfExecutor) caches the same, in the same order."""
        if not self._pictures():
            return
        states = self.scheduler.queues.states
        if self.computed is not None:
            for rid in report.plan.preempt:
                state = states.get(rid)
                if state is not None and state.num_computed_tokens:
                    self.computed.remember(_known(state, state.num_computed_tokens))
        outcomes = {o.request_id: o for o in report.outcome.outcomes}
        for result in outcomes.values():
            state = states.get(result.request_id)
            if state is not None and result.finished:
                output = [*state.output_token_ids, *result.new_token_ids]
                # A request ends with all but its last token computed; one the replica
                # aborted (its stream's reader left) with what it had computed.
                if result.finish_reason is FinishReason.ABORT:
                    upto = state.num_computed_tokens
                else:
                    upto = state.request.prompt_len + len(output) - 1
                prompt = state.request.prompt_token_ids
                self._remember_history(leading_tokens(prompt, output, upto))
        if self.computed is None:
            return
        for entry in report.plan.entries:
            state, ran = states.get(entry.request_id), outcomes.get(entry.request_id)
            if isinstance(entry, PrefillChunk) and state and ran and not ran.finished:
                self.computed.remember(_known(state, ran.num_computed_tokens))

    def _pictures(self) -> bool:
        """Whether the mirror keeps any picture of the replica's cache to feed."""
        return self.prefixes is not None or self.computed is not None

    def _remember_history(self, tokens: list[int]) -> None:
        """What a request that ended computed, in both pictures."""
        for picture in (self.prefixes, self.computed):
            if picture is not None:
                picture.remember(tokens)

    def _calibrate(self, report: StepReport) -> None:
        """Fold the step's measured seconds in, before the outcome moves the requests on (the
        shape is the one executed: the plan with each decode's drafts as verified, fewer where
        the engine made or kept fewer: near max_tokens, a short n-gram match, SpecServe's cuts;
        the draft work of drafts cut after they were made is then not in the shape, which errs
        toward a slower replica; the draft forwards of AdaServe's tree levels as the outcome
        reports them; a prefill chunk over the context it ran on, a prefix-cache hit the
        mirror learns of from this very report counted in, a credited prefix the replica did
        not find left out). Steps without work (abort reports) say nothing."""
        measured = report.outcome.total_s
        if self.perf is None or not isinstance(self.scheduler, SlosScheduler):
            return
        if not report.executed or measured <= 0:
            return
        states = self.scheduler.queues.states
        if any(e.request_id not in states for e in report.plan.entries):
            return
        plan = executed(report)
        after = {o.request_id: o.num_computed_tokens for o in report.outcome.outcomes}
        chunks = {e.request_id: e.num_tokens for e in plan.entries if isinstance(e, PrefillChunk)}

        def context(rid: str) -> int:
            if rid in chunks and rid in after:
                return after[rid] - chunks[rid]
            return states[rid].num_computed_tokens

        shape = BatchShape.of_plan(plan, context, self.profile.tp)
        outcome = report.outcome
        if outcome.draft_steps is not None and outcome.draft_batch is not None:
            shape = replace(shape, draft_steps=outcome.draft_steps, draft_batch=outcome.draft_batch)
        self.perf.observe(shape.features(), measured)

    @property
    def calibration(self) -> dict[str, float]:
        """Measured / predicted step time per observed shape class (empty: none yet)."""
        if self.perf is None:
            return {}
        return {str(cls): f for cls, f in self.perf.calibration.factors.items()}

    def status(self, waiting_for_verdict: int = 0) -> ReplicaStatus:
        queues = self.scheduler.queues
        admitted = len(self.admitted)
        return ReplicaStatus(
            replica=self.index,
            alive=self.alive,
            running=len(queues.running),
            waiting=len(queues.waiting) + waiting_for_verdict,
            admitted=admitted,
            best_effort=len(self.held) - admitted,
            kv_usage=queues.used_blocks() / self.cache.num_blocks,
            calibration=self.calibration,
        )

    def reset(self) -> None:
        """Forget everything (the replica died; its requests resume elsewhere)."""
        self.held.clear()
        self._bound_admitted.clear()
        self.regraded.clear()
        self.credits.clear()
        self.scheduler = self._new_scheduler()
        self.incarnation = ""
        self.seq = 0

    def restore(self, snapshot: ReplicaSnapshot, now: float) -> None:
        """Rebuild the mirror from what the replica holds.

        Progress is replayed as one synthetic step through the planner's own outcome path
        (`Scheduler.restore`: no token it replays is judged late), so the planner's
        bookkeeping stays its own: requests with cached tokens become running, the others
        wait with their tokens kept (like a preempted request). The picture of the prefix
        cache is kept unless the replica is a new incarnation. The requests are bound without
        a prefix credit: what they hold is what the replica says."""
        if snapshot.incarnation != self._pictured:
            self.prefixes, self.computed = self._new_pictures()
            self._pictured = snapshot.incarnation
        self.reset()
        self.incarnation = snapshot.incarnation
        self.seq = snapshot.seq
        entries = []
        outcomes = []
        for held in snapshot.requests:
            self._bind(held.request, now, held.admitted, 0)
            rid = held.request.request_id
            if held.num_computed > 0:
                entries.append(PrefillChunk(rid, held.num_computed))
            if held.num_computed > 0 or held.output_token_ids:
                outcomes.append(
                    RequestOutcome(
                        rid,
                        new_token_ids=list(held.output_token_ids),
                        num_computed_tokens=held.num_computed,
                    )
                )
        if outcomes:
            self.scheduler.restore(
                BatchPlan(entries=tuple(entries)),
                BatchOutcome(outcomes=outcomes, free_blocks=snapshot.free_blocks),
                now,
            )
        self._regrade(0, 0)  # what the new planner gave up restoring (reservations too big)


def _known(state: RequestState, upto: int) -> list[int]:
    """A request's first `upto` tokens so far: its prompt, then its output."""
    return leading_tokens(state.request.prompt_token_ids, state.output_token_ids, upto)


def _latest(history: deque[str], count: int) -> Iterator[str]:
    """The last `count` entries of a history, newest first (a bounded deque keeps more than
    a step adds)."""
    return islice(reversed(history), max(0, count))


def executed(report: StepReport) -> BatchPlan:
    """The step's plan with each decode's drafts as the engine verified them."""
    verified = {o.request_id: o.num_draft_tokens for o in report.outcome.outcomes}
    entries = tuple(
        DecodeStep(e.request_id, verified.get(e.request_id, e.num_spec_tokens))
        if isinstance(e, DecodeStep)
        else e
        for e in report.plan.entries
    )
    return BatchPlan(entries, report.plan.preempt)
