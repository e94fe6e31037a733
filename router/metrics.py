"""Prometheus metrics of the front door, vLLM-style names under the `slos_serve:` prefix.

One dedicated CollectorRegistry per front door, fed from three sources that never overlap, so
nothing is counted twice however many replicas a request touched:
- FinalRecords and token times (one per request, seen once at the door): latencies, SLO
  verdicts, admitted / best-effort / rejected, route hops;
- ClusterStatus (a snapshot, replaced at each scrape): per-replica running / waiting / KV usage,
  exported as gauges labelled by replica, so `sum()` in PromQL is the cluster total;
- the controller's own counters and histograms (planner latency, speculation tokens), passed on
  as they are, since only the controller sees them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cluster.api import ClusterStatus, FinalRecord, Verdict
from router.auth import DEFAULT_TENANT, UNKNOWN_TENANT

PREFIX = "slos_serve:"
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 5.0)
HOP_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0)
REJECT_REASONS = ("backup_policy", "unavailable", "bad_request", "unauthorized", "not_found")
CONTROLLER_COUNTERS = {
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed.", 1.0),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", 1.0),
    "steps": ("replica_steps", "Steps the replicas executed.", 1.0),
    "busy_us": ("replica_busy_seconds", "Time the replicas spent executing steps.", 1e-6),
    "preempted": (
        "num_preemptions",
        "Requests preempted: KV dropped, tokens kept, recomputed when they resume.",
        1.0,
    ),
    "preempted_tokens": (
        "preempted_tokens",
        "KV tokens preemptions dropped: work the replicas compute again.",
        1.0,
    ),
    "prefix_cache_queries": (
        "prefix_cache_queries",
        "Tokens looked up in the replicas' prefix caches as prefills began.",
        1.0,
    ),
    "prefix_cache_hits": (
        "prefix_cache_hits",
        "Of those, tokens found cached: computed once for several requests.",
        1.0,
    ),
    "prefix_credited": (
        "prefix_credited_tokens",
        "Prompt tokens admission counted cached on the replica a request was bound to, "
        "counted as its prefill began.",
        1.0,
    ),
    "prefix_credit_missed": (
        "prefix_credit_missed_tokens",
        "Of those, tokens the replica did not find cached: computed beyond the plan.",
        1.0,
    ),
    "mirror_rebuilds": (
        "mirror_rebuilds",
        "Mirrors of replicas the controller rebuilt from their snapshots: one a replica at "
        "start, more after a missed report or a replica's restart.",
        1.0,
    ),
    "demoted": (
        "requests_demoted",
        "Admitted requests that lost their guarantee (a missed deadline, or outgrown KV).",
        1.0,
    ),
    "promoted": (
        "requests_promoted",
        "Best-effort SLO requests a replica's planner guaranteed later, once a burst left "
        "room, before their first token (again if the replica's mirror was rebuilt).",
        1.0,
    ),
    "migrated": (
        "requests_migrated",
        "Requests resumed on another replica after theirs failed mid-stream, or after the "
        "controller took them back from a busy one (each move).",
        1.0,
    ),
    "rebalanced": (
        "requests_rebalanced",
        "Best-effort requests taken back, before their first step, from a replica far busier "
        "than another, to be bound again (also counted migrated).",
        1.0,
    ),
    "dead": (
        "replicas_dead",
        "Replicas found dead for good (Ray would not restart them: a restart that failed "
        "while loading, a kill without restart) and stopped, for another to start in their "
        "slot: at once in a fixed-size cluster, as its target needs in an autoscaled one.",
        1.0,
    ),
    "start_failed": (
        "replica_start_failures",
        "Replica starts that failed (a model folder gone, a device held, no resources): "
        "tried again after a pause, the last one's error in the cluster status's start_error.",
        1.0,
    ),
    "planner_errors": (
        "planner_errors",
        "Planning calls that raised (logged): an admission decision's requests route on, "
        "a replica's plan waits for the next report or tick.",
        1.0,
    ),
    "declined": (
        "requests_declined",
        "SLO requests no replica could guarantee within the route limit (then served "
        "best-effort or rejected): the autoscaler's slo signal.",
        1.0,
    ),
}
"""Controller counter -> (exported name, help, scale to the exported unit)."""
CONTROLLER_HISTOGRAMS = {
    "planner_latency_s": (
        "planner_latency_seconds",
        "Wall time of one admission decision (a replica's planner over a batch of arrivals).",
    ),
}


@dataclass(eq=False)
class ClusterCollector(Collector):
    """Exports the latest cluster snapshot; `refresh` replaces it (gauges, never sums)."""

    model: str
    status: ClusterStatus | None = None
    controller: Mapping[str, Any] = field(default_factory=dict)
    """{"counters": {name: int}, "histograms": {name: {bounds, counts, sum, count}}}."""

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running",
            "Requests in a replica's batch.",
            labels=["model", "replica"],
        )
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting",
            "Requests queued at a replica.",
            labels=["model", "replica"],
        )
        kv = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of KV blocks in use.",
            labels=["model", "replica"],
        )
        up = GaugeMetricFamily(
            PREFIX + "replica_up", "1 when the replica is alive.", labels=["model", "replica"]
        )
        replicas = GaugeMetricFamily(
            PREFIX + "num_replicas",
            "Replicas by state: serving, draining (finishing what they hold before they stop) "
            "and starting (loading their model), as the autoscaler moves them.",
            labels=["model", "state"],
        )
        target = GaugeMetricFamily(
            PREFIX + "replicas_target",
            "The replica count the autoscaler aims at (absent without an autoscaler).",
            labels=["model"],
        )
        for r in self.status.replicas if self.status else ():
            labels = [self.model, str(r.replica)]
            up.add_metric(labels, 1.0 if r.alive else 0.0)
            if r.alive:
                running.add_metric(labels, r.running)
                waiting.add_metric(labels, r.waiting)
                kv.add_metric(labels, r.kv_usage)
        if self.status is not None:
            draining = sum(r.draining for r in self.status.replicas)
            serving = sum(r.alive and not r.draining for r in self.status.replicas)
            replicas.add_metric([self.model, "serving"], serving)
            replicas.add_metric([self.model, "draining"], draining)
            replicas.add_metric([self.model, "starting"], self.status.starting)
            if self.status.target_replicas:
                target.add_metric([self.model], self.status.target_replicas)
        yield from (running, waiting, kv, up, replicas, target)
        counters = self.controller.get("counters")
        for key, (name, doc, scale) in CONTROLLER_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model"])
            if counters is not None:  # from 0 until the first event, as Prometheus expects
                family.add_metric([self.model], float(counters.get(key, 0)) * scale)
            yield family
        histograms = self.controller.get("histograms", {})
        for key, (name, doc) in CONTROLLER_HISTOGRAMS.items():
            hist_family = HistogramMetricFamily(PREFIX + name, doc, labels=["model"])
            hist = histograms.get(key)
            if hist is not None:
                hist_family.add_metric([self.model], _buckets(hist), sum_value=float(hist["sum"]))
            yield hist_family


def _buckets(hist: Mapping[str, Any]) -> list[tuple[str, float]]:
    """Cumulative buckets in Prometheus order, ending with +Inf = the total count."""
    pairs = [
        (repr(float(b)), float(c)) for b, c in zip(hist["bounds"], hist["counts"], strict=True)
    ]
    return [*pairs, ("+Inf", float(hist["count"]))]


MAX_STAGE_LABELS = 32
"""Distinct SLO stage names a front door labels its attainment counters with."""


class FrontDoorMetrics:
    """All metrics of one front door and its cluster, in their own registry."""

    def __init__(self, model: str, tenants: Sequence[str] = (DEFAULT_TENANT,)) -> None:
        """`tenants`: those whose request counters are exported from 0, before their first
        request, so that rates and alerts see a series from the start."""
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self._stage_labels: set[str] = set()
        by_tier = ["model", "tier"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to first output token.",
            by_tier,
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Gap between consecutive output tokens.",
            by_tier,
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to the last output token.",
            by_tier,
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        by_stage = ["model", "tier", "stage"]
        self.attained = Counter(
            PREFIX + "slo_attained", "SLO stages met.", by_stage, registry=self.registry
        )
        self.violated = Counter(
            PREFIX + "slo_violated", "SLO stages missed.", by_stage, registry=self.registry
        )
        by_tenant = ["model", "tenant"]
        self.admitted = Counter(
            PREFIX + "requests_admitted",
            "Requests admitted with an SLO guarantee.",
            by_tenant,
            registry=self.registry,
        )
        self.best_effort = Counter(
            PREFIX + "requests_best_effort",
            "Requests served by the best-effort tier.",
            by_tenant,
            registry=self.registry,
        )
        self.rejected = Counter(
            PREFIX + "requests_rejected",
            "Requests refused, by reason.",
            [*by_tenant, "reason"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            PREFIX + "requests_cancelled",
            "Requests whose client left (disconnect, deadline, cancel) before they finished, "
            "by the verdict the door had seen: admitted or best_effort (also counted as such), "
            "or unknown when the client left before the cluster's first answer.",
            [*by_tenant, "verdict"],
            registry=self.registry,
        )
        self.lost = Counter(
            PREFIX + "requests_lost",
            "Requests the server cut off after the cluster's first answer, by that verdict "
            "(also counted as such): the cluster could not continue them (no replica back "
            "within the resume wait, the controller unreachable), a fault of the server's "
            "ended them, or the door gave up a choice of a request whose other choice failed; "
            "the client got an error instead of the rest of its output.",
            [*by_tenant, "verdict"],
            registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "requests_finished",
            "Requests that ended with a finish reason (stop, length, abort: a fault in the "
            "request's own part of a step, or an output grammar it could no longer follow), "
            "by that reason; those rejected, cancelled or lost have none.",
            [*by_tenant, "finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of the requests served (admitted or best-effort).",
            by_tenant,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Output tokens the clients were given.",
            by_tenant,
            registry=self.registry,
        )
        self.hops = Histogram(
            PREFIX + "route_hops",
            "Replicas a request tried before its verdict.",
            ["model"],
            buckets=HOP_BUCKETS,
            registry=self.registry,
        )
        self.cluster = ClusterCollector(model)
        self.registry.register(self.cluster)
        served = (Verdict.ADMITTED.value, Verdict.BEST_EFFORT.value)
        for tenant in tenants:
            for counter in (
                self.admitted,
                self.best_effort,
                self.prompt_tokens,
                self.generation_tokens,
            ):
                counter.labels(model, tenant)
            for verdict in served:
                self.lost.labels(model, tenant, verdict)
            for verdict in (*served, "unknown"):
                self.cancelled.labels(model, tenant, verdict)
            for reason in REJECT_REASONS:
                if reason != "unauthorized":
                    self.rejected.labels(model, tenant, reason)
        self.rejected.labels(model, UNKNOWN_TENANT, "unauthorized")

    def record_tokens(self, tier: str, previous: float | None, times: Sequence[float]) -> None:
        """Observe the gaps between output tokens (`previous`: the token before `times`)."""
        for t in times:
            if previous is not None:
                self.itl.labels(self.model, tier).observe(max(0.0, t - previous))
            previous = t

    def record_final(self, record: FinalRecord, tier: str, tenant: str) -> None:
        """Count one finished request (called exactly once per request)."""
        if record.verdict is Verdict.REJECTED:
            self.reject(tenant, "backup_policy")
            self.hops.labels(self.model).observe(record.hops)
            return
        self._record_served(record, tier, tenant)
        if record.finish_reason is not None:
            self.finished.labels(self.model, tenant, record.finish_reason).inc()
        if record.finish_time is not None and record.num_output_tokens:
            self.e2e.labels(self.model, tier).observe(record.finish_time - record.arrival_time)

    def _record_served(self, record: FinalRecord, tier: str, tenant: str) -> None:
        """A request's verdict, route, first token and stages, finished or not."""
        counter = self.admitted if record.verdict is Verdict.ADMITTED else self.best_effort
        counter.labels(self.model, tenant).inc()
        self.prompt_tokens.labels(self.model, tenant).inc(record.num_prompt_tokens)
        self.generation_tokens.labels(self.model, tenant).inc(record.num_output_tokens)
        self.hops.labels(self.model).observe(record.hops)
        if record.first_token_time is not None:
            self.ttft.labels(self.model, tier).observe(
                record.first_token_time - record.arrival_time
            )
        for i, stage in enumerate(record.stages):
            name = self._stage_label(stage.name or str(i))
            target = self.attained if stage.attained else self.violated
            target.labels(self.model, tier, name).inc()

    def _stage_label(self, name: str) -> str:
        """Clients name their stages, so the label set is capped: names past the first
        MAX_STAGE_LABELS seen are counted as "other" rather than as new series forever."""
        if name in self._stage_labels or len(self._stage_labels) < MAX_STAGE_LABELS:
            self._stage_labels.add(name)
            return name
        return "other"

    def record_cancelled(self, record: FinalRecord | None, tier: str, tenant: str) -> None:
        """Count a request its client left, and what it got by then (`record`: no finish, its
        stages judged on the tokens it received and the one it was waiting for), as a
        finished one is counted, and cancelled. Left before the cluster's first answer
        (`record` None), it is counted cancelled alone, its verdict unknown to the door."""
        self._record_unfinished(self.cancelled, record, tier, tenant)

    def record_lost(self, record: FinalRecord | None, tier: str, tenant: str) -> None:
        """Count a request the server cut off mid-stream, as `record_cancelled` counts one
        its client left."""
        self._record_unfinished(self.lost, record, tier, tenant)

    def _record_unfinished(
        self, counter: Counter, record: FinalRecord | None, tier: str, tenant: str
    ) -> None:
        if record is None:
            counter.labels(self.model, tenant, "unknown").inc()
            return
        self._record_served(record, tier, tenant)
        counter.labels(self.model, tenant, record.verdict.value).inc()

    def reject(self, tenant: str, reason: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}; known: {REJECT_REASONS}")
        self.rejected.labels(self.model, tenant, reason).inc()

    def refresh(
        self, status: ClusterStatus | None, controller: Mapping[str, Any] | None = None
    ) -> None:
        self.cluster.status = status
        self.cluster.controller = controller or {}

    def exposition(self) -> bytes:
        return bytes(generate_latest(self.registry))
