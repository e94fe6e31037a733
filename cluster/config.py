"""The cluster's one configuration object: typed, validated, loadable from YAML.

Every field is checked when the object is built, so a bad config fails at start with the
field's name instead of deep inside a replica actor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import yaml

from cluster.autoscale import AutoscaleConfig, ScaleSignal
from cluster.choices import member
from cluster.routing import BackupPolicy, FirstHop
from replica.device import DTYPES
from replica.planner.adaserve import AdaServeConfig
from replica.planner.config import (
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
    check_text,
)

SPEC_POLICY = re.compile(r"^(none|slos|goodspeed|specserve|adaserve|ngram|fixed:[1-9][0-9]?)$")


_T = TypeVar("_T")


def built(cls: type[_T], data: Mapping[str, Any], where: str) -> _T:
    """`cls` from a mapping (a YAML section), an unknown field named with the known ones."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        raise ValueError(
            f"unknown {where} field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return cls(**data)


class SchedulerKind(StrEnum):
    """What plans each replica's steps and whether the controller controls admission."""

    SLOS = "slos"
    """SLOs-Serve: admission DP per replica, SLO-driven hops, backup policy."""
    VLLM = "vllm"
    """Baseline: every request admitted round-robin; prefill-first FCFS, unchunked."""
    SARATHI = "sarathi"
    """Baseline: every request admitted round-robin; decode-first chunked prefill with the
    token budget that fits the tightest tier's TPOT."""


class BestEffortOrder(StrEnum):
    """How the best-effort requests that cannot meet their next deadline (or have none) are
    served, after those that still can (slos only)."""

    FCFS = "fcfs"
    """Oldest first."""
    LAPS = "laps"
    """LAPS-SD: predictable requests holding KV by shortest predicted time, then the rest by
    attained service (replica.planner.laps)."""


@dataclass(frozen=True)
class TierConfig:
    """A named SLO tier clients can ask for by name (e.g. "chat", "code")."""

    name: str
    ttft_ms: float
    tpot_ms: float
    stages: tuple[Mapping[str, Any], ...] = ()
    """The tier's SLO stages, as a request's `slo.stages` (say a reasoning model's thinking
    `until: "</think>"`, then its answer): the front door parses them, with the tokenizer."""

    def __post_init__(self) -> None:
        check_text("tiers[].name", self.name)
        for key in ("ttft_ms", "tpot_ms"):
            check_positive(f"tiers[{self.name}].{key}", getattr(self, key))
        if not isinstance(self.stages, list | tuple) or not all(
            isinstance(stage, Mapping) for stage in self.stages
        ):
            raise ValueError(f"tiers[{self.name}].stages must be a list of stages (mappings)")
        object.__setattr__(self, "stages", tuple(self.stages))
        for i, stage in enumerate(self.stages):
            check_positive(f"tiers[{self.name}].stages[{i}].tpot_ms", stage.get("tpot_ms"))

    @property
    def tightest_tpot_ms(self) -> float:
        """With stages, theirs (their TPOTs set every deadline, as in SLO)."""
        if not self.stages:
            return self.tpot_ms
        return min(float(stage["tpot_ms"]) for stage in self.stages)


@dataclass(frozen=True)
class ClusterConfig:
    """What runs: replicas of one model (and draft), and how requests are admitted and routed."""

    model: str
    """The target checkpoint (HF format): a local folder or a hub repo id, fetched into the HF
    cache on first load (replica.model_source)."""
    draft: str | None = None
    """The draft checkpoint, the same way; None disables draft-model speculation."""
    model_name: str = "demo"
    """Name clients use in the `model` field."""
    replicas: int = 2
    """Replicas at the start; with `autoscale`, the autoscaler's bounds hold it after."""
    autoscale: AutoscaleConfig | None = None
    """The replica count follows the load: `{min_replicas, max_replicas, signal, ...}`
    (cluster.autoscale.AutoscaleConfig; signal slo needs scheduler slos). None: `replicas`
    run throughout."""
    scheduler: SchedulerKind = SchedulerKind.SLOS
    """slos | vllm | sarathi. The baselines need spec_policy none and round_robin first hops;
    route_limit and backup_policy do not apply to them."""
    spec_policy: str = "slos"
    """none | slos (SLO-adaptive lengths) | goodspeed (slos's drafts re-split between each
    step's requests of one tier by GOODSPEED, replica.planner.goodspeed) | specserve (slos's
    drafts cut short by the draft's confidences, SpecServe: replica.planner.specserve) |
    adaserve (slos's drafts verified as token trees, each step's spread over its requests by
    their SLOs, AdaServe: replica.planner.adaserve) | ngram | fixed:k."""
    adaserve: AdaServeConfig | None = None
    """With spec_policy adaserve: the trees' constants, `{max_width, max_nodes}`
    (replica.planner.adaserve.AdaServeConfig; None: its defaults, 4 and 15). Trees wider than
    4 or with more than 15 nodes per request leave the CPU kernels for the general path."""
    tiers: tuple[TierConfig, ...] = ()
    route_limit: int = 2
    first_hop: FirstHop = FirstHop.ROUND_ROBIN
    """round_robin | least_load | prefix (the replica likely caching the longest prefix of
    the prompt; cluster.routing.FirstHop)."""
    prefix_imbalance: int = 8
    """With first_hop prefix: requests a replica may hold beyond the least loaded one and
    still be chosen for its cached prefix (more, and the prefix is passed over), so traffic
    sharing a prefix spreads over the replicas. Raise it for replicas that hold hundreds."""
    backup_policy: BackupPolicy = BackupPolicy.BEST_EFFORT
    best_effort_order: BestEffortOrder = BestEffortOrder.FCFS
    """fcfs | laps (BestEffortOrder); slos only."""
    retry_after_s: float = 1.0
    tick_interval_ms: float = 10.0
    """Planning period of the controller."""
    num_kv_blocks: int = 1024
    """KV cache blocks (16 tokens each) per replica."""
    profile: str | None = None
    """Perf-model profile JSON; None: the shipped CPU profile."""
    calibrate: bool = False
    """Scale the profile's step times by the measured / predicted ratio of executed steps
    (per shape class, an EMA), so admission follows the replicas' real speed (slos only).
    Off by default: on the 2-core CPU cluster the ratios were 4-8x (steps sharing cores with
    Ray and the front door), and planning with them cut attainment at 8 req/s from 0.99 to
    0.69-0.82 (loadgen/RESULTS.md, real CPU cluster)."""
    prefix_caching: bool = True
    """Keep the KV of committed tokens for later requests that start with the same tokens
    (vLLM's automatic prefix caching; replica.kv_cache)."""
    credit_prefixes: bool = True
    """With prefix_caching: admission prices, and the replica's plan feeds, only the part of
    a prompt past the prefix the controller pictures cached on that replica (the prompts it
    computed and the histories that ended there, cluster.virtual_replica). The picture can be
    wrong (a prefix evicted since): the replica then computes what it lacks, a first token
    may come late, and the slos_serve:prefix_credit_missed_tokens counter says how often.
    False: every prefill is priced in full, on the safe side, and a hit is learned of from
    the step's report."""
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    tensor_parallel_size: int = 1
    """Processes (GPUs) one replica's target model is split over (replica.tensor_parallel)."""
    dtype: str = "auto"
    """Weights and KV cache precision: auto (bfloat16 on a GPU, float32 on CPU), float32,
    bfloat16 or float16."""
    arrival_wait_s: float = 30.0
    """How long a new request waits for a replica when none is up (the only one restarting,
    or being replaced), as Ray Serve queues requests while replicas start, before it is
    refused as unavailable (HTTP 503 with Retry-After). 0: refused at once."""
    resource_wait_s: float = 0.0
    """How long a launch waits for the Ray cluster to hold the GPUs a replica needs (GPU
    nodes still joining, as on Kubernetes, where the head takes the config before its
    workers are up; the autoscaler is asked for them) before it refuses. 0: at once."""
    door_lease_s: float = 10.0
    """How long a front door may go without renewing its lease (every quarter of it) before
    the controller ends its requests (within half a second more): no one reads them once the
    door has crashed or hung. A detached cluster no door renews for max(60 s, twice this)
    stops itself (10 minutes after a Serve update's door handed it over: leases.py). Longer
    keeps a live door on a starved machine (10 s lapsed once at load ~190 on 2 cores), but
    also a crashed door's lease: a delete within it leaves the cluster to stop itself."""

    def __post_init__(self) -> None:
        check_text("model", self.model)
        check_text("model_name", self.model_name)
        for name in ("draft", "profile"):
            check_text(name, getattr(self, name), optional=True)
        for name in ("replicas", "route_limit", "num_kv_blocks", "tensor_parallel_size"):
            check_int(name, getattr(self, name))
        check_int("prefix_imbalance", self.prefix_imbalance, low=0)
        for name in ("calibrate", "prefix_caching", "credit_prefixes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in (
            "retry_after_s",
            "num_cpus_per_replica",
            "num_gpus_per_replica",
            "arrival_wait_s",
            "resource_wait_s",
        ):
            check_non_negative(name, getattr(self, name))
        per_rank = self.num_gpus_per_replica / self.tensor_parallel_size
        if self.tensor_parallel_size > 1 and self.num_gpus_per_replica and per_rank % 1:
            # Ray would pack fractional ranks onto one device: shards sharing a GPU.
            raise ValueError(
                f"num_gpus_per_replica ({self.num_gpus_per_replica:g}) must be a multiple of "
                f"tensor_parallel_size ({self.tensor_parallel_size}): each rank on GPUs of its own"
            )
        check_positive("tick_interval_ms", self.tick_interval_ms)
        if self.tick_interval_ms > 10_000:
            raise ValueError(f"tick_interval_ms must be in (0, 10000], got {self.tick_interval_ms}")
        check_fraction("door_lease_s", self.door_lease_s, low=2.0, high=600.0)
        if not isinstance(self.spec_policy, str) or not SPEC_POLICY.match(self.spec_policy):
            raise ValueError(
                "spec_policy must be none, slos, goodspeed, specserve, adaserve, ngram or "
                "fixed:k (1-99), "
                f"got {self.spec_policy!r}"
            )
        if self.loads_draft and self.draft is None:
            raise ValueError(f"spec_policy={self.spec_policy!r} needs a draft model")
        self._check_adaserve()
        for name, kind in (
            ("first_hop", FirstHop),
            ("backup_policy", BackupPolicy),
            ("best_effort_order", BestEffortOrder),
        ):
            object.__setattr__(self, name, member(kind, name, getattr(self, name)))
        self._check_tiers()
        names = [t.name for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError(f"tier names must be unique, got {names}")
        self._check_scheduler()
        self._check_autoscale()
        if self.first_hop is FirstHop.PREFIX and not self.prefix_caching:
            raise ValueError(
                "first_hop prefix routes to the replica caching a prompt's prefix: it needs "
                "prefix_caching true"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def _check_tiers(self) -> None:
        """`tiers` as TierConfigs, from a list of mappings (YAML) or of TierConfigs."""
        if not isinstance(self.tiers, list | tuple):
            raise ValueError(f"tiers must be a list of tiers, got {self.tiers!r}")
        tiers = []
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, Mapping):
                tier = built(TierConfig, tier, f"tiers[{i}]")
            if not isinstance(tier, TierConfig):
                raise ValueError(
                    f"tiers[{i}] must be a mapping of name, ttft_ms, tpot_ms, got {tier!r}"
                )
            tiers.append(tier)
        object.__setattr__(self, "tiers", tuple(tiers))

    def _check_adaserve(self) -> None:
        if self.adaserve is None:
            return
        if self.spec_policy != "adaserve":
            raise ValueError(
                f"adaserve shapes AdaServe's token trees: set spec_policy to adaserve, got "
                f"{self.spec_policy!r}"
            )
        if isinstance(self.adaserve, Mapping):
            object.__setattr__(self, "adaserve", built(AdaServeConfig, self.adaserve, "adaserve"))
        if not isinstance(self.adaserve, AdaServeConfig):
            raise ValueError(
                f"adaserve must be a mapping of max_width and max_nodes, got {self.adaserve!r}"
            )

    def _check_autoscale(self) -> None:
        scale = self.autoscale
        if scale is None:
            return
        if isinstance(scale, Mapping):
            scale = built(AutoscaleConfig, scale, "autoscale")
            object.__setattr__(self, "autoscale", scale)
        if not isinstance(scale, AutoscaleConfig):
            raise ValueError(f"autoscale must be a mapping, got {scale!r}")
        scale.check_start(self.replicas)
        if scale.signal is ScaleSignal.SLO and self.scheduler is not SchedulerKind.SLOS:
            raise ValueError(
                f"autoscale signal slo follows admission's declines; scheduler="
                f"{self.scheduler.value} declines nothing (use signal ongoing)"
            )

    @property
    def slots(self) -> int:
        """Replicas that may run at once (autoscale's maximum, else `replicas`)."""
        return self.autoscale.max_replicas if self.autoscale else self.replicas

    def _check_scheduler(self) -> None:
        object.__setattr__(self, "scheduler", member(SchedulerKind, "scheduler", self.scheduler))
        if self.scheduler is SchedulerKind.SLOS:
            return
        if self.spec_policy != "none":
            raise ValueError(
                f"scheduler={self.scheduler.value} runs without speculation: set spec_policy "
                f"to none, got {self.spec_policy!r}"
            )
        if self.best_effort_order is not BestEffortOrder.FCFS:
            raise ValueError(
                f"scheduler={self.scheduler.value} has no best-effort tier: set "
                f"best_effort_order to fcfs, got {self.best_effort_order.value!r}"
            )
        if self.first_hop is not FirstHop.ROUND_ROBIN:
            raise ValueError(
                f"scheduler={self.scheduler.value} routes round-robin: set first_hop to "
                f"round_robin, got {self.first_hop.value!r}"
            )
        if self.scheduler is SchedulerKind.SARATHI and not self.tiers:
            raise ValueError(
                "scheduler=sarathi sizes its token budget from the tightest tier TPOT: "
                "configure tiers"
            )

    @property
    def loads_draft(self) -> bool:
        """Whether the replicas' engines load `draft`: every spec_policy but none and ngram
        drafts with it (those two ignore one that is set)."""
        return self.spec_policy not in ("none", "ngram")

    @property
    def spec_k(self) -> int:
        """The fixed speculation length of `fixed:k` (0 otherwise)."""
        return int(self.spec_policy.split(":")[1]) if self.spec_policy.startswith("fixed:") else 0

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise ValueError(f"unknown tier {name!r}; known: {[t.name for t in self.tiers]}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        if not isinstance(data, dict):
            raise ValueError(f"cluster config must be a mapping, got {type(data).__name__}")
        try:
            return built(cls, data, "cluster config")
        except TypeError as exc:
            raise ValueError(f"invalid cluster config: {exc}") from exc

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})
