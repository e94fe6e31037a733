"""Discrete-event run of the cluster: the live decision code against perf-model replicas.

Policy `slos` drives the same `ControlPlane` (virtual replicas with `SlosScheduler`, the
`Router` with its route limit and backup policy) as the Ray controller: arrivals are submitted
and planned at once, a planning tick every `tick_interval_s` admits and routes what still waits,
and after every step a replica folds
its report into its mirror and runs the mirror's next plan, as the live controller sends it.
It speculates with the profile's draft model; the engine accepts drafts per `SeededAcceptance`.
Its ablations switch one part off: `slos-noroute` (route limit 1: a declined request goes
straight to the backup policy), `slos-nospec` (no speculation), `slos-noadmit` (no admission
control: every request is admitted, in arrival order, as soon as its KV reservation fits).
`slos+laps` is slos with the best-effort tier's late requests in LAPS-SD's order
(`PlannerConfig.laps`, replica.planner.laps) rather than oldest first; `slos+goodspeed` re-splits
each step's drafts across its requests by GOODSPEED (`PlannerConfig.goodspeed`,
replica.planner.goodspeed), which pays off where requests accept drafts unequally
(`SimConfig.acceptance_spread`); `slos+specserve` drafts and verifies only the drafts SpecServe
finds worth their time from the draft's confidences (replica.planner.specserve), which the
simulated draft gives with `SimConfig.confidence_concentration`; `slos+adaserve` verifies each
step's planned drafts as AdaServe's token trees (replica.planner.adaserve), the draft's later
choices accepted as `SimConfig.sibling_acceptance` says (cluster.sim_spec.SimulatedTrees). With
`SimConfig.prefix_caching` every replica keeps its computed prompts and outputs for later
requests that start with the same tokens, and `slos+prefix` sends each request first to the
replica the controller pictures holding the longest prefix of it (FirstHop.PREFIX).
Policies `vllm` and `sarathi` have no admission: round-robin first hop, the baseline
scheduler per replica. `distserve` splits the replicas into a prefill pool (FCFS, prefill-first,
each request leaves after its first token) and a decode pool (the prompt's KV arrives over a
`KvLink`, then vLLM-style decoding). Every replica executes plans on `PerfExecutor`, whose perf
model is the clock (`SimConfig.replica_slowdown` makes that clock slower than the profile the
planners believe, as a loaded live machine is); the simulated engine alone knows each request's
true length and ends it there (EOS), while every scheduler plans with max_tokens. Deterministic
for a seed: no wall clock, and the only randomness (draft acceptance) comes from per-request
seeded streams. With `SimConfig.stop_below` a run ends as soon as its attainment can no longer
reach that (a capacity search's failing points, overloaded, are the slowest to simulate).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from cluster.api import Verdict
from cluster.autoscale import (
    SCALE_PERIOD_S,
    AutoscaleConfig,
    Autoscaler,
    ScaleSample,
    ScaleSignal,
    plan_resize,
)
from cluster.control import ControlPlane, Decision
from cluster.messages import StepReport
from cluster.plans import SeqView, reconcile
from cluster.routing import BackupPolicy, FirstHop, Router
from cluster.sim_distserve import DEFAULT_LINK_GB_S, KvLink
from cluster.sim_events import EventKind, EventQueue
from cluster.sim_spec import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_SIBLINGS,
    SeededAcceptance,
    SimulatedTrees,
)
from cluster.virtual_replica import VirtualReplica
from replica.batch import BatchOutcome, BatchPlan, PrefillChunk, RequestOutcome
from replica.kv_cache import PrefixPicture
from replica.perf_info import Slowdown
from replica.perf_model import PerfModel
from replica.planner.adaserve import AdaServeConfig, AdaServeTrees
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.baseline_sizing import sarathi_token_budget, vllm_config
from replica.planner.config import (
    GoodspeedConfig,
    LapsConfig,
    OutputEstimateConfig,
    PlannerConfig,
    SpecConfig,
)
from replica.planner.executor import PerfExecutor, token_id
from replica.planner.queues import peak_tokens
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.slos import SlosScheduler
from replica.planner.specserve import SpecServeLengths
from replica.planner.vllm import VllmScheduler
from replica.request import Request, Tier

_LATE_S = 1e-6
"""How far past its deadline a token must be to count as a certain miss for an early stop:
above the judge's round-off slack (loadgen.metrics.EPS_S), so every such miss is one there."""


class Policy(StrEnum):
    SLOS = "slos"
    SLOS_NOROUTE = "slos-noroute"
    SLOS_NOSPEC = "slos-nospec"
    SLOS_NOADMIT = "slos-noadmit"
    SLOS_LAPS = "slos+laps"
    SLOS_GOODSPEED = "slos+goodspeed"
    SLOS_SPECSERVE = "slos+specserve"
    SLOS_ADASERVE = "slos+adaserve"
    SLOS_PREFIX = "slos+prefix"
    VLLM = "vllm"
    SARATHI = "sarathi"
    DISTSERVE = "distserve"

    @property
    def is_slos(self) -> bool:
        """The controller and SlosScheduler drive it (slos, its ablations and policies)."""
        return self.value.startswith("slos")


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
    emits: tuple[tuple[int, int], ...] = ()
    """(output position, token id) the engine outputs there: a reasoning model's token that
    ends its thinking stage (Stage.end_token_ids), whose place the cluster learns only when
    it comes."""

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
    """slos (controller + SlosScheduler) or an ablation of it, vllm, sarathi or distserve."""
    replicas: int = 1
    """Replicas (one GPU each at TP 1); for distserve both pools together."""
    num_kv_blocks: int = 1024
    """KV cache blocks (16 tokens each) per replica."""
    tick_interval_s: float = 0.01
    """Planning period of the controller (policy slos)."""
    route_limit: int = 2
    """Replicas a request may try before the backup policy (policy slos; 1 for slos-noroute)."""
    backup_policy: BackupPolicy = BackupPolicy.BEST_EFFORT
    """What happens once every allowed hop declined (policy slos)."""
    planner: PlannerConfig = field(
        default_factory=lambda: PlannerConfig(
            spec=SpecConfig(), output_estimate=OutputEstimateConfig()
        )
    )
    """The SlosScheduler's knobs (policy slos): speculation, KV reservations from observed
    output lengths; see `planner_config` for what the policy overrides."""
    acceptance: float = DEFAULT_ACCEPTANCE
    """The draft's true per-token acceptance (the engine's truth; see cluster.sim_spec)."""
    acceptance_spread: float = 0.0
    """Each request's own acceptance is drawn uniformly within this of `acceptance` (clipped
    to [0, 1]): requests the draft predicts better or worse than others."""
    confidence_concentration: float | None = None
    """The simulated draft's confidences (cluster.sim_spec): each token's is drawn from a Beta
    law of mean its request's acceptance and this concentration, and it is accepted with that
    probability. None: no confidences (each token accepted with the request's acceptance);
    slos+specserve needs them."""
    sibling_acceptance: tuple[float, ...] = DEFAULT_SIBLINGS
    """slos+adaserve: the chance the target takes the draft's second, third, ... choice, each
    given it took none before (cluster.sim_spec.SimulatedTrees; the last value for every later
    rank)."""
    adaserve: AdaServeConfig = field(default_factory=AdaServeConfig)
    """slos+adaserve: the trees' constants (cluster.config.ClusterConfig.adaserve)."""
    seed: int = 0
    """Seeds the draft acceptance streams."""
    prefill_replicas: int = 1
    """Policy distserve: replicas in the prefill pool; the other replicas decode."""
    kv_link_gb_s: float = DEFAULT_LINK_GB_S
    """Policy distserve: bandwidth of each prefill replica's KV link."""
    kv_bytes_per_token: float | None = None
    """Policy distserve: KV bytes per token per GPU; None reads the profile's
    `kv_bytes_per_token_per_gpu` assumption."""
    replica_slowdown: Slowdown = field(default_factory=Slowdown)
    """How much slower the simulated replicas run than the profile every planner (and the
    controller's mirrors) believes: the live gap between a profile and a loaded machine."""
    stop_below: float | None = None
    """Stop the run as soon as its SLO attainment (deadline semantics) can no longer reach
    this: a capacity search only asks whether a rate passes, and an overloaded run, the
    slowest to simulate, fails long before its end. None: run to the end."""
    prefix_caching: bool = False
    """Each replica keeps the KV of the prompts and outputs it computed for later requests
    that start with the same tokens (replica.kv_cache.PrefixPicture stands for its cache): a prefill
    begins after the prefix found there, as a live replica's does. The requests' token ids
    must then say which prompts share what (loadgen.simulate.sim_requests)."""
    credit_prefixes: bool = True
    """With prefix_caching: each scheduler counts the prefix a new request finds cached as
    computed (cluster.config.ClusterConfig.credit_prefixes): slos's admission and plans by
    its controller's picture of the replica's cache, a baseline's by its replica's cache when
    the request arrives. False: every prefill planned in full, hits learned of as they run."""
    autoscale: AutoscaleConfig | None = None
    """The replica count follows the load (cluster.autoscale) within the config's bounds,
    from `replicas` at the start; None: `replicas` run throughout."""
    replica_startup_s: float = 60.0
    """With autoscale: how long a replica started takes to load its model; its GPU counts
    from the start."""

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
        SimulatedTrees(
            SeededAcceptance(
                self.acceptance, self.seed, self.acceptance_spread, self.confidence_concentration
            ),
            self.sibling_acceptance,
        )
        if self.policy is Policy.SLOS_SPECSERVE and self.confidence_concentration is None:
            raise ValueError(
                "slos+specserve drafts by the draft's confidences: set confidence_concentration"
            )
        if self.stop_below is not None and not 0 < self.stop_below <= 1:
            raise ValueError(f"stop_below must be in (0, 1], got {self.stop_below!r}")
        if not isinstance(self.replica_slowdown, Slowdown):
            raise ValueError(f"replica_slowdown must be a Slowdown, got {self.replica_slowdown!r}")
        if self.policy is Policy.SLOS_PREFIX and not self.prefix_caching:
            raise ValueError("slos+prefix routes by the replicas' caches: it needs prefix_caching")
        if self.prefix_caching and self.policy is Policy.DISTSERVE:
            raise ValueError("distserve is simulated without prefix caching")
        if self.policy is Policy.DISTSERVE and not 1 <= self.prefill_replicas < self.replicas:
            raise ValueError(
                f"prefill_replicas must be in [1, replicas={self.replicas}) for distserve "
                f"(both pools non-empty), got {self.prefill_replicas}"
            )
        if self.autoscale is not None:
            self._check_autoscale(self.autoscale)

    def _check_autoscale(self, scale: AutoscaleConfig) -> None:
        if self.policy is Policy.DISTSERVE:
            raise ValueError("distserve's pools are simulated at a fixed size: no autoscale")
        if scale.signal is ScaleSignal.SLO and (
            not self.policy.is_slos or self.policy is Policy.SLOS_NOADMIT
        ):
            raise ValueError(
                f"autoscale signal slo follows admission's declines; {self.policy.value} "
                "declines nothing (use signal ongoing)"
            )
        scale.check_start(self.replicas)
        if not self.replica_startup_s >= 0:
            raise ValueError(f"replica_startup_s must be >= 0, got {self.replica_startup_s!r}")

    @property
    def slots(self) -> int:
        """Replicas that may run at once."""
        return self.autoscale.max_replicas if self.autoscale else self.replicas

    @property
    def first_hop(self) -> FirstHop:
        return FirstHop.PREFIX if self.policy is Policy.SLOS_PREFIX else FirstHop.ROUND_ROBIN

    @property
    def effective_route_limit(self) -> int:
        return 1 if self.policy is Policy.SLOS_NOROUTE else self.route_limit

    @property
    def speculates(self) -> bool:
        return self.policy.is_slos and self.planner_config().spec is not None

    def planner_config(self) -> PlannerConfig:
        """The SlosScheduler's config: no speculation for slos-nospec; otherwise the planner's
        prior acceptance is the engine's alpha (it then follows observed verifies). slos+laps
        orders the best-effort tier by LAPS-SD and slos+goodspeed re-splits drafts by
        GOODSPEED (the planner's own settings when it has them)."""
        planner = self.planner
        spec = planner.spec
        if spec is not None and self.policy is not Policy.SLOS_NOSPEC:
            spec = replace(spec, initial_acceptance=self.acceptance)
        else:
            spec = None
        laps = planner.laps or (LapsConfig() if self.policy is Policy.SLOS_LAPS else None)
        goodspeed = planner.goodspeed or (
            GoodspeedConfig() if self.policy is Policy.SLOS_GOODSPEED else None
        )
        return replace(planner, spec=spec, laps=laps, goodspeed=goodspeed if spec else None)


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
class EarlyStop:
    """Why a run stopped before its end (SimConfig.stop_below)."""

    missed: int
    """Requests certain to miss by then: rejected, or a token past its deadline."""
    requests: int

    @property
    def attainment_at_most(self) -> float:
        return 1.0 - self.missed / self.requests


@dataclass(frozen=True)
class SimResult:
    outcomes: tuple[SimOutcome, ...]
    """One per request, in the order given (none when the run stopped early)."""
    steps: int
    end_s: float
    """Virtual time of the last event."""
    wall_s: float
    busy_s: float = 0.0
    """Virtual time the replicas spent running steps, summed over replicas: what the policy
    spent on the workload, so a capacity can be told apart from the hardware's limit."""
    stopped: EarlyStop | None = None
    """Set when the run stopped once it could no longer attain SimConfig.stop_below."""
    preemptions: int = 0
    preempted_tokens: int = 0
    """KV tokens the preemptions dropped, summed over replicas: work computed twice."""
    decode_steps: int = 0
    """Decodes executed (a request's share of a step), summed over replicas."""
    verified_drafts: int = 0
    """Draft tokens those decodes verified."""
    accepted_drafts: int = 0
    """Of those, the ones accepted."""
    prefix_queries: int = 0
    """With prefix caching: known tokens of the requests whose prefill began, looked up in
    their replica's cache, summed over replicas."""
    prefix_hits: int = 0
    """Of those, the tokens found cached."""
    credited_tokens: int = 0
    """slos policies with SimConfig.credit_prefixes: prompt tokens the controller counted
    cached when it bound their requests, summed over replicas."""
    credit_missed_tokens: int = 0
    """Of those, the tokens the replica did not find cached."""
    demoted: int = 0
    """slos policies: admitted requests whose guarantee the planner gave up (a missed
    deadline, or outgrown KV), summed over replicas."""
    promoted: int = 0
    """slos policies: promotions of best-effort SLO requests to a guarantee by a replica's
    planner (their outcomes' verdict is admitted, as a live client's; an admitted request
    demoted before its first token may be promoted again), summed over replicas."""
    replica_s: float = 0.0
    """GPU time: seconds each replica ran (started, serving or draining), summed."""
    scaling: tuple[tuple[float, int, int], ...] = ()
    """With autoscale: (time, replicas running, replicas taking requests) at every change."""

    @property
    def mean_replicas(self) -> float:
        """Replicas running on average over the run: its GPU time over its length."""
        return self.replica_s / self.end_s if self.end_s else 0.0


def tightest_tpot_s(requests: Sequence[Request]) -> float:
    """The smallest TPOT any request's deadlines are set by (its stages', if it has any)."""
    tpots = [r.slo.tightest_tpot_ms() for r in requests if r.slo is not None]
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
    landed: deque[int] = field(default_factory=deque)
    """Policy distserve, decode pool: requests whose KV arrived, waiting for memory."""

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


def kv_bytes_per_token(perf: PerfModel, override: float | None = None) -> float:
    """What distserve moves per token from a prefill to a decode replica: `override`, else the
    profile's `kv_bytes_per_token_per_gpu` (analytic profiles and `slos-serve profile` record
    it)."""
    per_token = override or perf.info.assumptions.get("kv_bytes_per_token_per_gpu")
    if not isinstance(per_token, int | float):
        raise ValueError(
            "distserve needs the KV bytes a token moves between replicas: the profile has no "
            "kv_bytes_per_token_per_gpu assumption (re-measure it with `slos-serve profile`)"
        )
    return float(per_token)


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
        self._produced = [0] * len(self.requests)
        self._judged = [
            None if r.request.slo is None else r.request.slo.after_tokens(r.emits)
            for r in self.requests
        ]
        """Each request's SLO as its emitted tokens end its stages (the early stop's judge)."""
        self._first_due: list[tuple[float, int]] = []
        """(first token deadline, request) of arrived requests, a heap (with stop_below)."""
        self._missed: set[int] = set()
        self._stopped = False
        self._events = EventQueue()
        self._steps = 0
        self._busy_s = 0.0
        self._now = 0.0
        cache = CacheBudget(config.num_kv_blocks)
        truth = perf if config.replica_slowdown.is_none else perf.slowed(config.replica_slowdown)
        self.router = Router(
            first_hop=config.first_hop,
            route_limit=config.effective_route_limit,
            backup_policy=config.backup_policy,
        )
        self.accept = SeededAcceptance(
            config.acceptance,
            config.seed,
            config.acceptance_spread,
            config.confidence_concentration,
        )
        self.plane: ControlPlane | None = None
        self._unadmitted: list[deque[tuple[int, Request]]] = []
        """Policy slos-noadmit: per replica, arrivals waiting for their KV reservation."""
        self._links: list[KvLink] = []
        self._inflight = [0] * config.slots
        """Policy distserve: KV transfers under way to each decode replica."""
        self._cache = cache
        self._truth = truth
        self._planner = config.planner_config()
        self._trees = (
            (
                AdaServeTrees(perf, config.adaserve),
                SimulatedTrees(self.accept, config.sibling_acceptance),
            )
            if config.policy is Policy.SLOS_ADASERVE and self._planner.spec is not None
            else None
        )
        """slos+adaserve: the trees every replica verifies, their calibration shared."""
        self.replicas = [self._build(i) for i in range(config.slots)]
        if config.policy.is_slos:
            mirrors = [rep.mirror for rep in self.replicas if rep.mirror is not None]
            self.plane = ControlPlane(mirrors, self.router)
            self._unadmitted = [deque() for _ in mirrors]
        self.autoscaler = (
            Autoscaler(config.autoscale, config.replicas) if config.autoscale else None
        )
        self._on: list[float | None] = [
            0.0 if i < config.replicas else None for i in range(config.slots)
        ]
        """Since when each replica's GPU is taken (None: off)."""
        self._starting: dict[int, float] = {}
        """Replicas starting, and when each is up (an event of a start since cancelled is
        ignored)."""
        self._retired: list[_Replica] = []
        """Replicas the autoscaler replaced by fresh ones: their counts stay in the result."""
        self._draining: set[int] = set()
        """Replicas that finish what they hold and take nothing new (the plane's own set)."""
        if self.plane is not None:
            self.plane.draining = self._draining
        self._replica_s = 0.0
        """GPU seconds of the replicas turned off so far."""
        self._scaling: list[tuple[float, int, int]] = []
        for i in range(config.replicas, config.slots):
            self._switch_off(i)
        self._note_scaling()
        if config.policy is Policy.DISTSERVE:
            per_token = kv_bytes_per_token(perf, config.kv_bytes_per_token)
            self._links = [
                KvLink(config.kv_link_gb_s, per_token) for _ in range(config.prefill_replicas)
            ]

    def _build(self, i: int) -> _Replica:
        """Replica i as it starts: an empty cache, and for slos a mirror that knows nothing."""
        config, perf, cache = self.config, self.perf, self._cache
        if not config.policy.is_slos:
            executor = PerfExecutor(self._truth, cache, prefixes=self._picture(cache))
            return _Replica(i, executor, self._baseline(cache), None)
        accept = self.accept if self._planner.spec is not None else None
        specserve = config.policy is Policy.SLOS_SPECSERVE and accept is not None
        mirror = VirtualReplica(
            i,
            perf,
            cache,
            self._planner,
            track_prefixes=config.first_hop is FirstHop.PREFIX,
            credit_prefixes=config.prefix_caching and config.credit_prefixes,
        )
        executor = PerfExecutor(
            self._truth,
            cache,
            accept,
            (SpecServeLengths(perf), self.accept.draws) if specserve else None,
            self._trees,
            self._picture(cache),
        )
        return _Replica(i, executor, mirror.scheduler, mirror)

    def _picture(self, cache: CacheBudget) -> PrefixPicture | None:
        """A replica's prefix cache, with prefix caching on."""
        if not self.config.prefix_caching:
            return None
        return PrefixPicture(cache.num_blocks, cache.block_size)

    def _baseline(self, cache: CacheBudget) -> Scheduler:
        seen = [r.request for r in self.requests]
        if self.config.policy is Policy.SARATHI:
            budget = sarathi_token_budget(self.perf, tightest_tpot_s(seen))
            return SarathiScheduler(cache, SarathiConfig(token_budget=budget))
        return VllmScheduler(cache, vllm_config(max(peak_tokens(r) for r in seen)))

    def run(self) -> SimResult:
        if self._steps or self._events:
            raise RuntimeError("a Simulator runs once; build a new one")
        started = time.perf_counter()
        for i, r in enumerate(self.requests):
            if r.follows is None:
                self._events.push(r.request.arrival_time, EventKind.ARRIVAL, i)
        if self.plane is not None and self._open:
            self._events.push(self.config.tick_interval_s, EventKind.TICK, 1)
        if self.autoscaler is not None and self._open:
            self._events.push(SCALE_PERIOD_S, EventKind.SCALE, 1)
        while self._events and not self._stopped:
            event = self._events.pop()
            if event.kind in (EventKind.SCALE, EventKind.REPLICA_UP) and not self._open:
                continue  # the run is over: scaling after it would stretch its end
            self._now = event.time
            if self._first_due:
                self._note_first_tokens_due()
            if event.kind is EventKind.STEP_DONE:
                self._step_done(event.target)
            elif event.kind is EventKind.TRANSFER_DONE:
                self._transfer_done(event.target)
            elif event.kind is EventKind.ARRIVAL:
                self._arrive(event.target)
            elif event.kind is EventKind.TICK:
                self._tick(event.target)
            elif event.kind is EventKind.REPLICA_UP:
                self._replica_up(event.target)
            else:
                self._scale(event.target)
        wall_s = time.perf_counter() - started
        replicas = [*self._retired, *self.replicas]
        executors = [rep.executor for rep in replicas]
        mirrors = [rep.mirror for rep in replicas if rep.mirror is not None]
        result = SimResult(
            (),
            self._steps,
            self._now,
            wall_s,
            self._busy_s,
            preemptions=sum(len(e.preemptions) for e in executors),
            preempted_tokens=sum(e.preempted_tokens for e in executors),
            decode_steps=sum(len(e.drafted) for e in executors),
            verified_drafts=sum(sum(e.drafted) for e in executors),
            accepted_drafts=sum(e.accepted_drafts for e in executors),
            prefix_queries=sum(e.prefix_queries for e in executors),
            prefix_hits=sum(e.prefix_hits for e in executors),
            credited_tokens=sum(m.credited_tokens for m in mirrors),
            credit_missed_tokens=sum(m.credit_missed_tokens for m in mirrors),
            demoted=sum(m.num_demoted for m in mirrors),
            promoted=sum(m.num_promoted for m in mirrors),
            replica_s=self._replica_s + sum(self._now - on for on in self._on if on is not None),
            scaling=tuple(self._scaling),
        )
        if self._stopped:
            return replace(result, stopped=EarlyStop(len(self._missed), len(self.requests)))
        if self._open:
            raise RuntimeError(f"simulation stalled with {self._open} request(s) unfinished")
        return replace(result, outcomes=tuple(self._outcome(i) for i in range(len(self.requests))))

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
        if self.config.stop_below is not None and request.slo is not None:
            heapq.heappush(self._first_due, (now + request.slo.deadline_s(0), i))
        if self.plane is not None:
            if self.config.policy is Policy.SLOS_NOADMIT and request.tier is Tier.SLO:
                first = self.router.first(self.plane.loads(), self.plane.routable())
                assert first is not None
                self._unadmitted[first].append((i, request))
                return
            decision = self.plane.submit(request, now)
            if decision is not None:
                self._bind(decision)
                self._kick_all()
            else:
                self._plan()
            return
        routable = self._routable()
        if self._links:
            routable = routable[: self.config.prefill_replicas]
        replica = self.router.first([0.0] * len(routable), routable)
        assert replica is not None
        rep = self.replicas[replica]
        credit = 0
        if self.config.credit_prefixes and rep.executor.prefixes is not None:
            credit = rep.executor.prefixes.cached_prompt(request.prompt_token_ids)
        rep.scheduler.add_request(request, now, credit)
        self._start(i, request, Verdict.ADMITTED, replica, 1)
        self._kick(rep)

    def _plan(self) -> None:
        """One planning pass, as the live controller runs on every tick and arrival."""
        assert self.plane is not None
        for decision in self.plane.tick(self._now):
            self._bind(decision)
        self._admit_in_order()
        self._kick_all()

    def _tick(self, number: int) -> None:
        assert self.plane is not None
        self._plan()
        if not self._open:
            return
        self._check_progress()
        self._events.push((number + 1) * self.config.tick_interval_s, EventKind.TICK, number + 1)

    def _check_progress(self) -> None:
        """Raise when nothing but the periodic events is left to move the open requests on."""
        periodic = (self.plane is not None) + (self.autoscaler is not None)
        waiting = self.plane is not None and any(
            self.plane.num_pending(i) for i in range(len(self.replicas))
        )
        waiting = waiting or any(self._unadmitted) or any(r.running for r in self.replicas)
        if len(self._events) < periodic and not waiting:
            raise RuntimeError(f"simulation stalled at t={self._now} with work left")

    def _step_done(self, replica: int) -> None:
        rep = self.replicas[replica]
        assert rep.running is not None
        plan, outcome = rep.running
        rep.running = None
        rep.fold(plan, outcome, self._now)
        for result in outcome.outcomes:
            if self.config.stop_below is not None and result.new_token_ids:
                self._note_tokens(self._index[result.request_id], len(result.new_token_ids))
            if result.finished:
                i = self._index[result.request_id]
                track = self._tracks[i]
                track.times += tuple(rep.executor.release(result.request_id))
                self.accept.forget(result.request_id)
                if replica < len(self._links) and self.requests[i].output_len > 1:
                    self._send_kv(replica, i)
                else:
                    self._close(i)
        self._kick(rep)
        if replica in self._draining:
            self._retire_drained()

    def _transfer_done(self, i: int) -> None:
        replica = self._tracks[i].replica
        assert replica is not None
        self._inflight[replica] -= 1
        rep = self.replicas[replica]
        rep.landed.append(i)
        self._kick(rep)

    # -- autoscaling (SimConfig.autoscale) ------------------------------------------------------

    def _routable(self) -> list[bool]:
        if self.plane is not None:
            return self.plane.routable()
        return [
            on is not None and i not in self._starting and i not in self._draining
            for i, on in enumerate(self._on)
        ]

    def _scale(self, number: int) -> None:
        assert self.autoscaler is not None
        target = self.autoscaler.observe(self._sample())
        self._resize(target)
        self._retire_drained()
        if not self._open:
            return
        self._check_progress()
        self._events.push((number + 1) * SCALE_PERIOD_S, EventKind.SCALE, number + 1)

    def _sample(self) -> ScaleSample:
        if self.plane is not None:
            sample = self.plane.scale_sample(self._now)
            queued = sum(
                len(q) for q, ok in zip(self._unadmitted, self._routable(), strict=True) if ok
            )
            return replace(sample, ongoing=sample.ongoing + queued)
        routable = self._routable()
        ongoing = sum(
            len(rep.executor.sequences) + len(rep.landed)
            for rep, ok in zip(self.replicas, routable, strict=True)
            if ok
        )
        return ScaleSample(self._now, 0, 0, 0, ongoing, sum(routable))

    def _resize(self, target: int) -> None:
        """Start, stop, drain or take back replicas (cluster.autoscale.plan_resize)."""
        on = [i for i, t in enumerate(self._on) if t is not None]
        starting = sorted(self._starting)
        serving = [i for i in on if i not in self._starting and i not in self._draining]
        steps = plan_resize(target, serving, starting, sorted(self._draining), self._load)
        self._draining.difference_update(steps.undrain)
        for _ in range(steps.start):
            i = self._on.index(None)
            self._on[i] = self._now
            up = self._starting[i] = self._now + self.config.replica_startup_s
            self._events.push(up, EventKind.REPLICA_UP, i)
        for i in steps.cancel:
            del self._starting[i]
            self._switch_off(i)
        for i in steps.drain:
            if self.plane is not None:
                self.plane.drain(i)
            else:
                self._draining.add(i)
        self._note_scaling()

    def _load(self, i: int) -> int:
        rep = self.replicas[i]
        return len(rep.mirror.held) if rep.mirror else len(rep.executor.sequences)

    def _replica_up(self, i: int) -> None:
        """A started replica takes requests, from an empty cache (unless it was stopped)."""
        if self._starting.get(i) != self._now:
            return
        del self._starting[i]
        self._retired.append(self.replicas[i])
        rep = self.replicas[i] = self._build(i)
        if self.plane is not None:
            assert rep.mirror is not None
            self.plane.replicas[i] = rep.mirror
        self._note_scaling()

    def _retire_drained(self) -> None:
        for i in sorted(self._draining):
            rep = self.replicas[i]
            busy = rep.running or rep.has_work() or rep.executor.sequences
            waiting = self._unadmitted and self._unadmitted[i]
            if busy or waiting or (self.plane is not None and self.plane.num_pending(i)):
                continue
            self._draining.discard(i)
            self._switch_off(i)

    def _switch_off(self, i: int) -> None:
        on = self._on[i]
        if on is not None:
            self._replica_s += self._now - on
        self._on[i] = None
        if self.plane is not None:
            self.plane.replicas[i].alive = False
        self._note_scaling()

    def _note_scaling(self) -> None:
        if self.autoscaler is None:
            return
        running = sum(on is not None for on in self._on)
        point = (self._now, running, sum(self._routable()))
        if self._scaling and self._scaling[-1][1:] == point[1:]:
            return
        if self._scaling and self._scaling[-1][0] == self._now:
            self._scaling[-1] = point
        else:
            self._scaling.append(point)

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

    def _admit_in_order(self) -> None:
        """Policy slos-noadmit: admit each replica's arrivals in order while their KV
        reservation fits the memory not reserved yet; no SLO check."""
        assert self.plane is not None
        for vr, queue in zip(self.plane.replicas, self._unadmitted, strict=True):
            planner = vr.scheduler
            assert isinstance(planner, SlosScheduler)
            while queue and planner.admission_blocks(queue[0][1]) <= planner.unreserved_blocks:
                i, request = queue.popleft()
                vr.admit(request, self._now)
                self._start(i, request, Verdict.ADMITTED, vr.index, 1)

    def _start(self, i: int, request: Request, verdict: Verdict, replica: int, hops: int) -> None:
        track = self._tracks[i]
        track.verdict, track.replica, track.hops = verdict, replica, hops
        # distserve: the prefill replica ends the request at its first token.
        stop_after = 1 if self._links else self.requests[i].output_len
        self.replicas[replica].executor.add(
            request, stop_after=stop_after, emits=self.requests[i].emits
        )

    def _send_kv(self, prefill: int, i: int) -> None:
        """Policy distserve: ship the prompt's KV to the decode replica holding the fewest
        requests (lowest index on ties); it lands after the link's queue and transfer time."""
        target = min(range(len(self._links), len(self.replicas)), key=self._decode_load)
        self._tracks[i].replica = target
        self._inflight[target] += 1
        done = self._links[prefill].send(self._now, self.requests[i].request.prompt_len)
        self._events.push(done, EventKind.TRANSFER_DONE, i)

    def _decode_load(self, replica: int) -> tuple[int, int]:
        rep = self.replicas[replica]
        return len(rep.executor.sequences) + len(rep.landed) + self._inflight[replica], replica

    def _place_landed(self, rep: _Replica) -> None:
        """Policy distserve: move landed requests into the decode replica, oldest first, while
        their cached prompt and first token fit the free blocks and no preempted request
        waits to resume (it keeps its turn). A placed request is running: its prompt is
        cached, its first token known."""
        assert isinstance(rep.scheduler, VllmScheduler)
        queues = rep.scheduler.queues
        while rep.landed and not queues.waiting:
            i = rep.landed[0]
            request = self.requests[i].request
            prompt = request.prompt_len
            if queues.budget.blocks_for(prompt + 1) > queues.free_blocks():
                return
            rep.landed.popleft()
            rid = request.request_id
            first = token_id(rid, 0, self.requests[i].emits)
            arrived = replace(request, arrival_time=self._tracks[i].arrival_s or 0.0)
            rep.scheduler.add_request(arrived, self._now)
            rep.scheduler.update_from_outcome(
                BatchPlan(entries=(PrefillChunk(rid, prompt),)),
                BatchOutcome(outcomes=[RequestOutcome(rid, [first], prompt)]),
                self._now,
            )
            rep.executor.add(
                arrived,
                output=[first],
                computed=prompt,
                stop_after=self.requests[i].output_len,
                emits=self.requests[i].emits,
            )

    def _kick_all(self) -> None:
        """After bindings (all of a tick's first: a plan may hold any of them)."""
        for rep in self.replicas:
            if rep.has_work():
                self._kick(rep)

    def _kick(self, rep: _Replica) -> None:
        """Start the replica's next step unless one is running or there is nothing to do."""
        if rep.running is not None:
            return
        if rep.landed:
            self._place_landed(rep)
        plan = rep.next_plan(self._now)
        if plan is not None and rep.mirror is not None:
            self._regrade(rep.mirror.take_regraded())
        if plan is not None and rep.executor.attach_prefixes(plan):
            plan = reconcile(plan, _views(rep.executor, plan))
        if plan is None:
            return
        outcome, duration = rep.executor.execute(plan, self._now)
        rep.running = (plan, outcome)
        self._steps += 1
        self._busy_s += duration
        self._events.push(self._now + duration, EventKind.STEP_DONE, rep.index)

    def _regrade(self, regraded: dict[str, bool]) -> None:
        """A replica's plan goes with the guarantees its planner changed: a promoted request
        is admitted, as a live client learns from its stream (cluster.handle)."""
        for rid, admitted in regraded.items():
            track = self._tracks[self._index[rid]]
            if admitted and track.verdict is Verdict.BEST_EFFORT:
                track.verdict = Verdict.ADMITTED

    def _close(self, i: int) -> None:
        """Request i is done (finished or rejected): issue its follow-up rounds, or, when it
        was rejected, reject them too (the session cannot go on)."""
        self._open -= 1
        rejected = self._tracks[i].verdict is Verdict.REJECTED
        if rejected and self.config.stop_below is not None:
            self._miss(i)
        for j in self._followers.get(self.requests[i].request.request_id, []):
            if rejected:
                self._tracks[j].arrival_s = self._now
                self._tracks[j].verdict = Verdict.REJECTED
                self._close(j)
            else:
                self._events.push(self._now + self.requests[j].delay_s, EventKind.ARRIVAL, j)

    # -- early stop (SimConfig.stop_below) ------------------------------------------------------

    def _note_tokens(self, i: int, count: int) -> None:
        """Tokens of request i out now: a miss if the first of them is past its deadline."""
        first = self._produced[i]
        self._produced[i] += count
        slo = self._judged[i]
        arrival = self._tracks[i].arrival_s
        if (
            slo is not None
            and arrival is not None
            and self._now > arrival + slo.deadline_s(first) + _LATE_S
        ):
            self._miss(i)

    def _note_first_tokens_due(self) -> None:
        """Requests whose first token fell due before now without one are misses."""
        while self._first_due and self._first_due[0][0] + _LATE_S < self._now:
            _, i = heapq.heappop(self._first_due)
            if self._produced[i] == 0:
                self._miss(i)

    def _miss(self, i: int) -> None:
        self._missed.add(i)
        n = len(self.requests)
        assert self.config.stop_below is not None
        if (n - len(self._missed)) / n < self.config.stop_below:
            self._stopped = True


def _views(executor: PerfExecutor, plan: BatchPlan) -> dict[str, SeqView]:
    """The plan's requests as `reconcile` reads them, from the simulated engine."""
    ids = {e.request_id for e in plan.entries} | set(plan.preempt)
    return {
        rid: SeqView(s.num_known, s.computed, len(s.output))
        for rid in ids
        if not (s := executor.sequences[rid]).finished
    }
