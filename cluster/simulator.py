"""Discrete-event run of the cluster: the live decision code against perf-model replicas.

Policy `slos` drives the same `ControlPlane` (virtual replicas with `SlosScheduler`, the
`Router` with its route limit and backup policy) as the Ray controller: arrivals are submitted,
a planning tick every `tick_interval_s` admits and routes, and after every step a replica folds
its report into its mirror and runs the mirror's next plan, as the live controller sends it.
Policies `vllm` and `sarathi` have no admission: round-robin first hop, the baseline
scheduler per replica. Every replica executes plans on `PerfExecutor`, whose perf model is the
clock; the simulated engine alone knows each request's true length and ends it there (EOS),
while every scheduler plans with max_tokens. Deterministic: no wall clock, no randomness.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from cluster.api import Verdict
from cluster.control import ControlPlane, Decision
from cluster.messages import StepReport
from cluster.routing import BackupPolicy, FirstHop, Router
from cluster.sim_events import EventKind, EventQueue
from cluster.virtual_replica import VirtualReplica
from replica.batch import BatchOutcome, BatchPlan
from replica.perf_model import BatchShape, PerfModel
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.config import PlannerConfig
from replica.planner.executor import PerfExecutor
from replica.planner.queues import peak_tokens
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.vllm import VllmConfig, VllmScheduler
from replica.request import Request

DEFAULT_VLLM_BATCHED_TOKENS = VllmConfig().max_num_batched_tokens


class Policy(StrEnum):
    SLOS = "slos"
    VLLM = "vllm"
    SARATHI = "sarathi"


@dataclass(frozen=True)
class SimRequest:
    """A request to issue, with the truth only the simulated engine knows."""

    request: Request
    """What the cluster sees (plans with max_tokens)."""
    output_len: int
    """True output length: the engine ends the request there, as if it sampled EOS."""
    follows: str | None = None
    """A follow-up round, issued `delay_s` after this request id's last token."""
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.output_len <= self.request.sampling.max_tokens:
            raise ValueError(
                f"{self.request.request_id}: output_len={self.output_len} must be in "
                f"[1, max_tokens={self.request.sampling.max_tokens}]"
            )
        if self.delay_s < 0:
            raise ValueError(f"{self.request.request_id}: delay_s must be >= 0")


@dataclass(frozen=True)
class SimConfig:
    """How the simulated cluster runs."""

    policy: Policy = Policy.SLOS
    """slos (controller + SlosScheduler), vllm or sarathi (baselines, no admission)."""
    replicas: int = 1
    num_kv_blocks: int = 1024
    """KV cache blocks (16 tokens each) per replica."""
    tick_interval_s: float = 0.01
    """Planning period of the controller (policy slos)."""
    route_limit: int = 2
    """Replicas a request may try before the backup policy (policy slos)."""
    backup_policy: BackupPolicy = BackupPolicy.BEST_EFFORT
    """What happens once every allowed hop declined (policy slos)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The SlosScheduler's knobs (policy slos)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        object.__setattr__(self, "backup_policy", BackupPolicy(self.backup_policy))
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int):
            raise ValueError(f"replicas must be an integer, got {self.replicas!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not self.tick_interval_s > 0:
            raise ValueError(f"tick_interval_s must be > 0, got {self.tick_interval_s}")
        if self.route_limit < 1:
            raise ValueError(f"route_limit must be >= 1, got {self.route_limit}")


@dataclass(frozen=True)
class SimOutcome:
    """What happened to one request."""

    request_id: str
    arrival_s: float
    verdict: Verdict
    replica: int | None
    hops: int
    """Replicas tried, the final one included (0 when rejected without trying any)."""
    token_times_s: tuple[float, ...]


@dataclass(frozen=True)
class SimResult:
    outcomes: tuple[SimOutcome, ...]
    """One per request, in the order given."""
    steps: int
    end_s: float
    """Virtual time of the last event."""
    wall_s: float


def sarathi_token_budget(perf: PerfModel, tpot_s: float) -> int:
    """Largest step (query tokens, one chunk on an empty cache) the perf model fits in
    `tpot_s`: Sarathi-Serve's chunk size chosen from the tightest TPOT; at least 1."""

    def fits(n: int) -> bool:
        return perf.predict(BatchShape((n,), (0,), tp=perf.tp)) <= tpot_s

    if not fits(1):
        return 1
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def tightest_tpot_s(requests: Sequence[Request]) -> float:
    """The smallest TPOT any request (or stage) asks for."""
    tpots = [
        tpot
        for r in requests
        if r.slo is not None
        for tpot in (r.slo.tpot_ms, *(s.tpot_ms for s in r.slo.stages))
    ]
    if not tpots:
        raise ValueError("no request has an SLO to size the sarathi token budget from")
    return min(tpots) / 1e3


@dataclass
class _Replica:
    """A simulated replica: the engine twin plus whatever plans its steps."""

    index: int
    executor: PerfExecutor
    scheduler: Scheduler
    mirror: VirtualReplica | None
    """Policy slos: the controller's mirror, which plans and folds reports."""
    running: tuple[BatchPlan, BatchOutcome] | None = None

    def next_plan(self, now: float) -> BatchPlan | None:
        return self.mirror.next_plan(now) if self.mirror else self.scheduler.schedule(now)

    def fold(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        if self.mirror is None:
            self.scheduler.update_from_outcome(plan, outcome, now)
            return
        self.mirror.apply(StepReport(self.index, "", self.mirror.seq + 1, plan, outcome, now))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()


@dataclass
class _Track:
    arrival_s: float | None = None
    verdict: Verdict | None = None
    replica: int | None = None
    hops: int = 0
    times: tuple[float, ...] = ()


class Simulator:
    """One run of a workload; `run` may be called once."""

    def __init__(self, perf: PerfModel, requests: Sequence[SimRequest], config: SimConfig):
        ids = [r.request.request_id for r in requests]
        if len(ids) != len(set(ids)):
            raise ValueError("request ids must be unique")
        self.perf = perf
        self.config = config
        self.requests = list(requests)
        self._index = {rid: i for i, rid in enumerate(ids)}
        self._followers: dict[str, list[int]] = {}
        for i, r in enumerate(self.requests):
            if r.follows is not None:
                if r.follows not in self._index:
                    raise ValueError(f"{ids[i]} follows unknown request {r.follows!r}")
                self._followers.setdefault(r.follows, []).append(i)
        self._tracks = [_Track() for _ in self.requests]
        self._open = len(self.requests)
        self._events = EventQueue()
        self._steps = 0
        self._now = 0.0
        cache = CacheBudget(config.num_kv_blocks)
        self.router = Router(
            first_hop=FirstHop.ROUND_ROBIN,
            route_limit=config.route_limit,
            backup_policy=config.backup_policy,
        )
        self.plane: ControlPlane | None = None
        if config.policy is Policy.SLOS:
            mirrors = [
                VirtualReplica(i, perf, cache, config.planner) for i in range(config.replicas)
            ]
            self.plane = ControlPlane(mirrors, self.router)
            self.replicas = [
                _Replica(i, PerfExecutor(perf, cache), m.scheduler, m)
                for i, m in enumerate(mirrors)
            ]
        else:
            self.replicas = [
                _Replica(i, PerfExecutor(perf, cache), self._baseline(cache), None)
                for i in range(config.replicas)
            ]

    def _baseline(self, cache: CacheBudget) -> Scheduler:
        seen = [r.request for r in self.requests]
        if self.config.policy is Policy.SARATHI:
            budget = sarathi_token_budget(self.perf, tightest_tpot_s(seen))
            return SarathiScheduler(cache, SarathiConfig(token_budget=budget))
        longest = max(peak_tokens(r) for r in seen)
        return VllmScheduler(
            cache, VllmConfig(max_num_batched_tokens=max(DEFAULT_VLLM_BATCHED_TOKENS, longest))
        )

    def run(self) -> SimResult:
        if self._steps or self._events:
            raise RuntimeError("a Simulator runs once; build a new one")
        started = time.perf_counter()
        for i, r in enumerate(self.requests):
            if r.follows is None:
                self._events.push(r.request.arrival_time, EventKind.ARRIVAL, i)
        if self.plane is not None and self._open:
            self._events.push(self.config.tick_interval_s, EventKind.TICK, 1)
        while self._events:
            event = self._events.pop()
            self._now = event.time
            if event.kind is EventKind.STEP_DONE:
                self._step_done(event.target)
            elif event.kind is EventKind.ARRIVAL:
                self._arrive(event.target)
            else:
                self._tick(event.target)
        if self._open:
            raise RuntimeError(f"simulation stalled with {self._open} request(s) unfinished")
        outcomes = tuple(self._outcome(i) for i in range(len(self.requests)))
        return SimResult(outcomes, self._steps, self._now, time.perf_counter() - started)

    def _outcome(self, i: int) -> SimOutcome:
        track = self._tracks[i]
        assert track.verdict is not None and track.arrival_s is not None
        return SimOutcome(
            self.requests[i].request.request_id,
            track.arrival_s,
            track.verdict,
            track.replica,
            track.hops,
            track.times,
        )

    # -- events ---------------------------------------------------------------------------------

    def _arrive(self, i: int) -> None:
        now = self._now
        sim = self.requests[i]
        request = sim.request
        if sim.follows is not None:
            request = replace(request, arrival_time=now)
        self._tracks[i].arrival_s = now
        if self.plane is not None:
            decision = self.plane.submit(request, now)
            if decision is not None:
                self._bind(decision)
                self._kick_all()
            return
        replica = self.router.first([0.0] * len(self.replicas), [True] * len(self.replicas))
        assert replica is not None
        rep = self.replicas[replica]
        rep.scheduler.add_request(request, now)
        self._start(i, request, Verdict.ADMITTED, replica, 1)
        self._kick(rep)

    def _tick(self, number: int) -> None:
        assert self.plane is not None
        for decision in self.plane.tick(self._now):
            self._bind(decision)
        self._kick_all()
        if not self._open:
            return
        waiting = any(self.plane.num_pending(i) for i in range(len(self.replicas)))
        if not self._events and not waiting and not any(r.running for r in self.replicas):
            raise RuntimeError(f"simulation stalled at t={self._now} with work left")
        self._events.push((number + 1) * self.config.tick_interval_s, EventKind.TICK, number + 1)

    def _step_done(self, replica: int) -> None:
        rep = self.replicas[replica]
        assert rep.running is not None
        plan, outcome = rep.running
        rep.running = None
        rep.fold(plan, outcome, self._now)
        for result in outcome.outcomes:
            if result.finished:
                i = self._index[result.request_id]
                self._tracks[i].times = tuple(rep.executor.release(result.request_id))
                self._close(i)
        self._kick(rep)

    # -- helpers --------------------------------------------------------------------------------

    def _bind(self, decision: Decision) -> None:
        binding = decision.binding
        i = self._index[binding.request_id]
        if binding.verdict in (Verdict.ADMITTED, Verdict.BEST_EFFORT):
            assert binding.replica is not None
            self._start(i, decision.request, binding.verdict, binding.replica, binding.hops)
            return
        track = self._tracks[i]
        track.verdict, track.hops = Verdict.REJECTED, binding.hops
        self._close(i)

    def _start(self, i: int, request: Request, verdict: Verdict, replica: int, hops: int) -> None:
        track = self._tracks[i]
        track.verdict, track.replica, track.hops = verdict, replica, hops
        self.replicas[replica].executor.add(request, stop_after=self.requests[i].output_len)

    def _kick_all(self) -> None:
        """After bindings (all of a tick's first: a plan may hold any of them)."""
        for rep in self.replicas:
            if rep.has_work():
                self._kick(rep)

    def _kick(self, rep: _Replica) -> None:
        """Start the replica's next step unless one is running or there is nothing to do."""
        if rep.running is not None:
            return
        plan = rep.next_plan(self._now)
        if plan is None:
            return
        outcome, duration = rep.executor.execute(plan, self._now)
        rep.running = (plan, outcome)
        self._steps += 1
        self._events.push(self._now + duration, EventKind.STEP_DONE, rep.index)

    def _close(self, i: int) -> None:
        """Request i is done (finished or rejected): issue its follow-up rounds, or, when it
        was rejected, reject them too (the session cannot go on)."""
        self._open -= 1
        rejected = self._tracks[i].verdict is Verdict.REJECTED
        for j in self._followers.get(self.requests[i].request.request_id, []):
            if rejected:
                self._tracks[j].arrival_s = self._now
                self._tracks[j].verdict = Verdict.REJECTED
                self._close(j)
            else:
                self._events.push(self._now + self.requests[j].delay_s, EventKind.ARRIVAL, j)
