"""`slos-serve simulate`: SLO attainment and serving capacity per policy, in simulation.

Generates a paper scenario's workload (or a mix file's: your own application classes,
loadgen.mixes), runs it through `cluster.simulator` for each policy and
replica count, and judges the records with loadgen.metrics (deadline semantics). `--rate` is
requests per second per replica; `--capacity` searches the highest such rate with >= 90%
attainment (loadgen.capacity) and summarizes slos against the best baseline as a geometric
mean of capacity ratios, plus scaling over replica counts and ablation variants when present
(loadgen.capacity_tables). `--size-for RATES` asks the converse: the fewest replicas per
policy that serve each total rate (loadgen.sizing), every count replaying the same requests.
`--paper-table` runs the paper's 1-replica six-scenario comparison; `--plot` draws
loadgen.plots' figures (distserve, which runs several pool splits, has no burst timeline).
Arrivals: Poisson, or a trace rescaled to the rate: the scenario's Azure trace, a mix's own, or
`--trace` (any CSV in the Azure format; the JSON's `traces` names each workload's, with its
attribution). `--jobs` runs the searches in worker processes; every run is deterministic, so
the output is the same.

A live run's conditions replay with `--zero-load` (its measured SLOs), `--length-scale` and
`--baseline-profile` (the no-draft profile for policies without a draft); `--replica-slowdown`
and `--step-overhead-ms` run the replicas slower than the profile every planner believes, the
gap a loaded live machine opens (loadgen/RESULTS.md: the CPU cluster runs ~5x its profile).

Each run reports its replicas' busy time (`utilization`, `busy_ms_per_request`), its preemptions
and the KV they dropped (`preemptions`, `preempted_tokens`: prefill the replicas do again when
those requests resume), with `--prefix-caching` the share of the tokens looked up in the
replicas' caches that were found there (`prefix_hit_rate`) and the share of the prompt tokens
slos's controller counted cached that were not (`prefix_credit_missed`), its speculation
(`drafts_per_decode` verified, the `draft_acceptance` of those), and the header a `work_bound`
per scenario: the least replica time a request costs without speculation (or prefix caches) on
the simulated replicas, whose inverse caps the rate any such policy sustains (a finite run can
pass above it by finishing its backlog after the last arrival). A policy near full utilization
at its capacity is out of hardware, not out of scheduling; ratios above the bound over a
baseline's capacity need less work per request (speculation), not a better order. So each run
also reports how long its arrivals lasted (`arrival_window_s`) and how long it kept working
after the last one (`backlog_s`); a passing run whose backlog outlasts its arrivals is not
`sustained` (it batched a queue after the arrivals stopped), and a search whose capacity is
such a run says so (`capacity_searches[].sustained`, and a warning: lengthen --duration).
A capacity at the search's ceiling or floor is a bound, not a measurement: it is marked, and
left out of the ratios (loadgen.capacity_tables).

Every rate of one search replays the same requests, only compressed or stretched in time (the
paper's "truncate and rescale"): their count is fixed so the run at the reference rate (the
search's start, or `--rate`) lasts `--duration`. A window that grew with the rate would replay
other stretches of a bursty trace at each rate, and attainment would not fall monotonically.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from cluster.sim_distserve import DEFAULT_LINK_GB_S, pool_splits
from cluster.sim_spec import DEFAULT_ACCEPTANCE, DEFAULT_SIBLINGS
from cluster.simulator import (
    Policy,
    SimConfig,
    SimRequest,
    SimResult,
    Simulator,
    kv_bytes_per_token,
)
from loadgen.arrivals import poisson_arrivals, trace_arrivals
from loadgen.autoscaling import (
    ScaleChoice,
    autoscale_summary,
    autoscale_table,
    parse_choices,
    scaled_run,
)
from loadgen.capacity import DEFAULT_TARGET, CapacityResult, check_rel_tol, find_capacity
from loadgen.capacity_tables import ABLATION_PREFIX, Bound, Bounds, markdown_tables, summarize
from loadgen.metrics import RunReport, report
from loadgen.mixes import parse_workload
from loadgen.plots import (
    attainment_panels,
    burst_timeline,
    capacity_bars,
    figure_paths,
    plot_attainment,
    plot_capacity,
    plot_replicas_needed,
    plot_sizing,
    plot_timelines,
    replicas_needed,
    sizing_panels,
)
from loadgen.records import RequestRecord, Verdict
from loadgen.sizing import SizingResult, find_replicas, rate_key, sizing_table, summarize_sizing
from loadgen.traces import read_trace
from loadgen.workloads import (
    Scenario,
    SLOTargets,
    Workload,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    shared_prompts,
    trace_file,
    zero_load_decode_step_s,
    zero_load_ttft_from,
)
from loadgen.zero_load import ZeroLoad
from replica import compiled
from replica.arguments import (
    OptionError,
    non_negative_int,
    output_file,
    plot_file,
    positive_float,
    positive_int,
    unit_interval,
    unit_intervals,
)
from replica.perf_info import Slowdown
from replica.perf_model import PerfModel
from replica.planner.adaserve import AdaServeConfig
from replica.planner.base import CacheBudget
from replica.planner.executor import OUTPUT_TOKENS, token_ids
from replica.planner.queues import peak_tokens
from replica.profiles import load_profile

ROOT = Path(__file__).resolve().parent.parent
TRACE_DIR = ROOT.parent / "shared" / "data" / "azure-llm-inference-2023"
T = TypeVar("T")
R = TypeVar("R")


def trace_path(workload: Workload) -> Path:
    """The workload's trace: its Azure file, or a mix's own CSV."""
    return TRACE_DIR / trace_file(workload)


DEFAULT_KV_BLOCKS = 2048
"""KV blocks per replica for a profile that assumes no capacity, unless --kv-blocks says."""


def profile_kv_tokens(perf: PerfModel) -> int | None:
    """The KV cache a profile assumes, in tokens (`kv_capacity_tokens`), if it says."""
    tokens = perf.info.assumptions.get("kv_capacity_tokens")
    return int(tokens) if isinstance(tokens, int | float) else None


def kv_blocks(perf: PerfModel, given: int | None, block_size: int = 16) -> int:
    """KV blocks per replica: the profile's `kv_capacity_tokens` assumption when it has one,
    else `given` (--kv-blocks; None: DEFAULT_KV_BLOCKS). --kv-blocks with such a profile would
    be ignored, so it is refused."""
    tokens = profile_kv_tokens(perf)
    if tokens is None:
        return DEFAULT_KV_BLOCKS if given is None else given
    if given is not None:
        raise OptionError(
            f"--kv-blocks: the profile sets the KV cache itself (kv_capacity_tokens {tokens}, "
            f"{tokens // block_size} blocks); drop --kv-blocks"
        )
    return tokens // block_size


def sim_requests(
    workload: Sequence[WorkloadRequest], shared_tokens: bool = False
) -> list[SimRequest]:
    """The cluster's view (max_tokens only) plus the engine's truth (output_len).

    The perf model prices token counts, so prompts are zeros, unless `shared_tokens` (for
    prefix caches, SimConfig.prefix_caching) gives them ids that share what the live ones
    share: a class's system prompt, and a follow-up round's history (the round before it,
    prompt and the output the simulated engine gives it, then new tokens)."""
    ids = itertools.count(OUTPUT_TOKENS)  # above the ids the simulated engine outputs

    def new(count: int) -> list[int]:
        return list(itertools.islice(ids, count))

    def after(head: list[int], count: int) -> list[int]:
        return [*head, *new(count - len(head))]

    def history(before: WorkloadRequest, prompt: list[int]) -> list[int]:
        return [*prompt, *token_ids(before.request_id, 0, before.output_len, before.emits)]

    prompts = (
        shared_prompts(workload, new, after, history)
        if shared_tokens
        else {w.request_id: [0] * w.prompt_len for w in workload}
    )
    return [
        SimRequest(
            w.to_request(prompts[w.request_id], arrival_time=w.arrival_s),
            w.output_len,
            w.follows,
            w.delay_s,
            w.emits,
        )
        for w in workload
    ]


def records(workload: Sequence[WorkloadRequest], result: SimResult) -> list[RequestRecord]:
    out = []
    for w, o in zip(workload, result.outcomes, strict=True):
        out.append(
            RequestRecord.for_request(
                w,
                verdict=Verdict(o.verdict.value),
                token_times_s=o.token_times_s,
                arrival_s=o.arrival_s,
                replica=None if o.replica is None else str(o.replica),
                hops=max(0, o.hops - 1),
            )
        )
    return out


@dataclass(frozen=True)
class Backlog:
    """How long a run's arrivals lasted, first to last (a session's later rounds are its
    cost, not arrivals), and how long it kept working after the last one: its last token
    minus that arrival (None when it stopped early). Few requests at a high rate arrive at
    once and pass by being batched after the arrivals stop: a rate they could not sustain."""

    arrival_window_s: float
    backlog_s: float | None

    def sustained(self, passed: bool) -> bool | None:
        """Whether a passing run finished within its arrival window after its last arrival
        (None for a failing run: there is no rate to vouch for)."""
        if not passed:
            return None
        return self.backlog_s is not None and self.backlog_s <= self.arrival_window_s


def backlog(workload: Sequence[WorkloadRequest], result: SimResult) -> Backlog:
    """The run's `Backlog`, from its requests' arrivals and the result's last token."""
    arrivals = [w.arrival_s for w in workload if w.follows is None]
    last = max(arrivals)
    if result.stopped is not None:
        return Backlog(last - min(arrivals), None)
    finish = max((o.token_times_s[-1] for o in result.outcomes if o.token_times_s), default=last)
    return Backlog(last - min(arrivals), max(0.0, finish - last))


def simulate_workload(
    perf: PerfModel, workload: Sequence[WorkloadRequest], config: SimConfig
) -> tuple[RunReport | None, SimResult, list[RequestRecord]]:
    """Run a workload and judge it: the report, the raw result, the per-request records (no
    report and no records for a run that stopped early, `SimConfig.stop_below`)."""
    result = Simulator(perf, sim_requests(workload, config.prefix_caching), config).run()
    if result.stopped is not None:
        return None, result, []
    recs = records(workload, result)
    return report(recs), result, recs


@dataclass(frozen=True)
class Setup:
    """Everything fixed across the rates of one search."""

    perf: PerfModel
    scenario: Workload
    arrivals: str
    requests_per_replica: int
    """The same at every rate of the search (Plan.requests_per_replica)."""
    seed: int
    num_kv_blocks: int
    tick_interval_s: float
    route_limit: int
    acceptance: float = DEFAULT_ACCEPTANCE
    """The draft's per-token acceptance in the simulated engine (slos and its ablations)."""
    acceptance_spread: float = 0.0
    """Each request's own acceptance lies uniformly within this of `acceptance`."""
    confidence_concentration: float | None = None
    """The simulated draft's confidences (SimConfig.confidence_concentration)."""
    sibling_acceptance: tuple[float, ...] = DEFAULT_SIBLINGS
    """slos+adaserve's later draft choices (SimConfig.sibling_acceptance)."""
    adaserve: AdaServeConfig = field(default_factory=AdaServeConfig)
    """slos+adaserve's tree constants (SimConfig.adaserve)."""
    kv_link_gb_s: float = DEFAULT_LINK_GB_S
    """distserve's KV link bandwidth."""
    window_replicas: int | None = None
    """With --same-window, every replica count replays this many replicas' requests (the
    largest count's), so its capacity compares with the others' on the same requests."""
    baseline_perf: PerfModel | None = None
    """The profile of replicas without a draft model (policies that never speculate); None:
    `perf`. A measured profile with a draft charges every prompt token the draft's prefill."""
    slowdown: Slowdown = field(default_factory=Slowdown)
    """How much slower the simulated replicas run than the profiles the planners believe."""
    length_scale: float = 1.0
    """Multiplies every Table 4 length, as `slos-serve loadgen --length-scale` does."""
    zero_load: ZeroLoad | None = None
    """Measured zero-load numbers (a live run's probe): the SLOs then come from them as in
    that run (TPOT tiers from its decode step); None: from `perf`, at the GPU levels."""
    trace: Path | None = None
    """The trace CSV trace arrivals replay (--trace); None: the scenario's own."""
    stop_below: float | None = None
    """Runs stop once they can no longer attain this (SimConfig.stop_below): searches only
    ask pass or fail. None: every run to its end (`--rate`, `--full-runs`)."""
    prefix_caching: bool = False
    """The replicas keep computed prompts for later requests (SimConfig.prefix_caching)."""
    credit_prefixes: bool = True
    """Schedulers count a cached prefix as computed (SimConfig.credit_prefixes)."""

    def requests(self, replicas: int) -> int:
        return max(2, self.requests_per_replica * (self.window_replicas or replicas))

    def workload(self, rate: float, replicas: int) -> list[WorkloadRequest]:
        """The search's requests at `rate` per replica: the same ones at every rate, only
        compressed or stretched in time. A workload that cannot be made, or whose longest
        request could never fit a replica's KV cache (a planner would raise mid-run), is
        refused naming what to change: the work bounds make every search's workload before
        any run, so the refusal comes first."""
        cluster_rate = rate * replicas
        n = self.requests(replicas)
        config = self.workload_config()
        if self.arrivals == "trace":
            trace = read_trace(self.trace or trace_path(self.scenario))
            rows = trace_arrivals(trace, cluster_rate, n, self.seed)
            times = [r.time_s for r in rows]
        else:
            times = list(poisson_arrivals(cluster_rate, n, self.seed))
        try:
            workload = generate_workload(self.scenario, times, config, self.seed)
        except ValueError as exc:
            raise OptionError(f"--scenario {self.scenario.value}: {exc}") from None
        self._check_fits(workload)
        return workload

    def _check_fits(self, workload: Sequence[WorkloadRequest]) -> None:
        cache = CacheBudget(self.num_kv_blocks)
        longest = max(workload, key=lambda r: r.prompt_len + r.max_tokens)
        need = cache.blocks_for(peak_tokens(longest.to_request([0] * longest.prompt_len, 0.0)))
        if need <= cache.num_blocks:
            return
        where, fixes = f"--scenario {self.scenario.value}", ["lower --length-scale"]
        if not isinstance(self.scenario, Scenario):
            where += f": class {longest.scenario!r}"
            fixes.insert(0, "shorten the class's prompt or max_tokens")
        if profile_kv_tokens(self.perf) is None:
            source = "--kv-blocks"
            fixes.append(f"raise --kv-blocks to {need}")
        else:
            source = "the profile's kv_capacity_tokens"
        raise OptionError(
            f"{where}: request {longest.request_id} needs {need} KV blocks at its longest "
            f"(prompt {longest.prompt_len} + max_tokens {longest.max_tokens}), more than a "
            f"replica's {cache.num_blocks} ({source}): {' or '.join(fixes)}"
        )

    def workload_config(self) -> WorkloadConfig:
        if self.zero_load is None:
            return WorkloadConfig(zero_load_ttft_from(self.perf), length_scale=self.length_scale)
        return WorkloadConfig(
            self.zero_load.ttft_s,
            targets=SLOTargets.for_decode_step(self.zero_load.decode_step_s),
            length_scale=self.length_scale,
        )

    def tpots_under_a_step(self) -> list[str]:
        """One warning per class whose tightest TPOT target is under one decode step of its
        request alone on the profile (without drafts): admission cannot guarantee such a
        request, so slos serves it best-effort, behind the admitted work, while a policy that
        admits everything may still meet its deadlines, the TTFT slack absorbing the extra
        time (sizing QA: slos needed over 64 replicas where vllm needed 4)."""
        perf = self.perf_for(Policy.VLLM).slowed(self.slowdown)
        worst: dict[str, tuple[float, float]] = {}
        for r in self.workload(1.0, 1):
            tpot = min([r.slo.tpot_ms, *(s.tpot_ms for s in r.slo.stages)])
            step = 1e3 * zero_load_decode_step_s(perf, r.prompt_len)
            if tpot < step and tpot / step < worst.get(r.slo_class, (1.0, 0.0))[0]:
                worst[r.slo_class] = (tpot / step, step)
        return [
            f"warning: {self.scenario.value} class {name}: a TPOT target of {ratio:.0%} of one "
            f"decode step of its request alone ({step:.3g} ms): admission cannot guarantee "
            "it, so slos serves such requests best-effort; raise the target or use a faster "
            "profile"
            for name, (ratio, step) in sorted(worst.items())
        ]

    def work_bound(self, replicas: int) -> tuple[float, float]:
        """(mean ms, rate per replica): the least replica time the search's requests cost
        without speculation or prefix caches on the simulated replicas
        (`PerfModel.least_work_seconds`; the lengths are the same at every rate), and the rate
        it caps every non-speculating policy's sustained throughput at, in the search's unit
        (arrivals: a ToolLLM session's later rounds count in its cost, not as arrivals). A
        finite run can pass at a higher rate, finishing its backlog after the last arrival;
        so can one with prefix caches, whose hits are work not done."""
        truth = self.perf_for(Policy.VLLM).slowed(self.slowdown)
        workload = self.workload(1.0, replicas)
        total = truth.least_work_seconds((r.prompt_len, r.output_len) for r in workload)
        arrivals = sum(r.follows is None for r in workload)
        return 1e3 * total / len(workload), arrivals / total

    def perf_for(self, policy: Policy) -> PerfModel:
        """The profile `policy`'s replicas run (and plan) with: the baseline profile for
        policies that run no draft model."""
        drafts = policy.is_slos and policy is not Policy.SLOS_NOSPEC
        return self.perf if drafts or self.baseline_perf is None else self.baseline_perf

    def run(
        self, policy: Policy, replicas: int, rate: float
    ) -> tuple[RunReport | None, SimResult, Backlog]:
        """One policy at `rate` per replica; distserve reports its best pool split. The report
        is None for a run that stopped early (`stop_below`)."""
        if policy is Policy.DISTSERVE:
            _, run_report, result, run_backlog = max(
                self.distserve_runs(replicas, rate), key=lambda r: attainment(r[1], r[2])
            )
            return run_report, result, run_backlog
        return self._run(self.config(policy, replicas), rate)

    def distserve_runs(
        self, replicas: int, rate: float
    ) -> list[tuple[tuple[int, int], RunReport | None, SimResult, Backlog]]:
        """distserve at each prefill:decode split (cluster.sim_distserve.RATIOS) of
        max(replicas, 2) replicas: one GPU cannot be split, so at 1 it runs a 1:1 pair and
        `rate` stays per replica (per GPU at TP 1), comparable with the other policies."""
        instances = max(replicas, 2)
        runs = []
        for prefill, decode in pool_splits(instances):
            config = replace(self.config(Policy.DISTSERVE, instances), prefill_replicas=prefill)
            runs.append(((prefill, decode), *self._run(config, rate)))
        return runs

    def config(self, policy: Policy, replicas: int) -> SimConfig:
        return SimConfig(
            policy=policy,
            replicas=replicas,
            num_kv_blocks=self.num_kv_blocks,
            tick_interval_s=self.tick_interval_s,
            route_limit=self.route_limit,
            acceptance=self.acceptance,
            acceptance_spread=self.acceptance_spread,
            confidence_concentration=self.confidence_concentration,
            sibling_acceptance=self.sibling_acceptance,
            adaserve=self.adaserve,
            seed=self.seed,
            prefill_replicas=max(1, replicas // 2),
            kv_link_gb_s=self.kv_link_gb_s,
            replica_slowdown=self.slowdown,
            stop_below=self.stop_below,
            prefix_caching=self.prefix_caching,
            credit_prefixes=self.credit_prefixes,
        )

    def _run(self, config: SimConfig, rate: float) -> tuple[RunReport | None, SimResult, Backlog]:
        workload = self.workload(rate, config.replicas)
        run_report, result, _ = simulate_workload(self.perf_for(config.policy), workload, config)
        return run_report, result, backlog(workload, result)


def attainment(run_report: RunReport | None, result: SimResult) -> float:
    """A run's deadline attainment; for a run stopped early, the most it could have reached
    (below the target it stopped under)."""
    if run_report is not None:
        return run_report.overall.attainment
    assert result.stopped is not None
    return result.stopped.attainment_at_most


DEFAULT_PROFILE = "a100-40gb-opt-7b-tp1"
PAPER_POLICIES = (Policy.SLOS, Policy.VLLM, Policy.SARATHI, Policy.DISTSERVE)
ABLATION_POLICIES = (Policy.SLOS, *(p for p in Policy if p.startswith(ABLATION_PREFIX)))
"""--ablation's: slos and its variants with one part switched off."""
PAPER_DURATION_S = 300.0
PAPER_REL_TOL = 0.1
START_RATES: dict[Scenario, float] = {
    Scenario.CHATBOT: 3.0,
    Scenario.CODER: 1.5,
    Scenario.SUMMARIZER: 2.0,
    Scenario.MIXED: 3.0,
    Scenario.TOOLLLM: 0.4,
    Scenario.REASONING: 0.1,
}
"""Where each scenario's search starts unless --start-rate says: near its capacities on the A100
OPT-7B profile, so fewer overloaded runs (the slow ones) are spent bracketing. With the duration
they also fix the scenario's request count (the run at the start rate lasts that duration)."""
MIX_START_RATE = 1.0
"""Where a mix file's search starts unless --start-rate says (req/s per replica)."""
PAPER_DURATIONS_S: dict[Workload, float] = {Scenario.REASONING: 1200.0}
"""Longer runs where 300 s holds too few requests: reasoning's capacity is a few requests per
100 s, so 300 s gave 12 per point, where one miss is 8% of the attainment."""
PAPER_FIXED = ("profile", "scenario", "policies", "replicas", "ablation", "same_window")
"""Options --paper-table sets itself."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        help="name in deploy/profiles, a deploy config's short name (a100-opt7b for "
        f"serve-a100-opt7b.yaml's) or path (default {DEFAULT_PROFILE})",
    )
    parser.add_argument(
        "--scenario",
        help=f"comma list of {[s.value for s in Scenario]} and mix files (.yaml/.json: your own "
        f"application classes, loadgen.mixes; a mix's search starts at {MIX_START_RATE:g} req/s "
        "unless --start-rate says) (default chatbot)",
    )
    parser.add_argument(
        "--policies",
        help=f"comma list of {[p.value for p in Policy]} (default slos,vllm,sarathi)",
    )
    parser.add_argument("--replicas", help="comma list of replica counts (default 1)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="requests per second per replica")
    mode.add_argument("--capacity", action="store_true", help="search the capacity per policy")
    mode.add_argument(
        "--size-for",
        metavar="RATES",
        help="comma list of requests per second in all: for each, search the fewest replicas "
        "per policy that serve it at 90%% attainment (every count replays the same requests: "
        "--duration's worth at that rate; loadgen.sizing)",
    )
    mode.add_argument(
        "--paper-table",
        action="store_true",
        help=f"the paper's 1-replica capacity table: six scenarios, {DEFAULT_PROFILE}, "
        f"policies {','.join(PAPER_POLICIES)}, trace arrivals, {PAPER_DURATION_S:g} s ("
        + ", ".join(f"{s.value} {d:g} s" for s, d in PAPER_DURATIONS_S.items())
        + f"), --rel-tol {PAPER_REL_TOL}",
    )
    parser.add_argument(
        "--full-runs",
        action="store_true",
        help="run every point of a search (--capacity, --size-for) to its end; by default a "
        "point stops as soon as it can no longer attain 90%%, and reports the most it could "
        "have reached (an overloaded run is the slowest to simulate)",
    )
    parser.add_argument(
        "--max-replicas",
        type=int,
        help="--size-for's ceiling: failing there reports the count as not found (default 64)",
    )
    parser.add_argument(
        "--autoscale",
        metavar="SIGNALS",
        help="with --size-for: also replay each count's requests with the replica count left "
        "to an autoscaler (cluster.autoscale) between 1 and twice the fixed count found, from "
        "that count, once per signal in this comma list: slo (admission's declines; slos "
        "policies) or ongoing:TARGET (Ray Serve's rule: TARGET requests per replica); reports "
        "the attainment and the mean replicas (GPU seconds over the run's length)",
    )
    parser.add_argument(
        "--replica-startup-s",
        type=float,
        help="with --autoscale: seconds a started replica takes to load its model (default "
        f"{SimConfig.replica_startup_s:g})",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="policies = slos and its variants with one part off: " + ",".join(ABLATION_POLICIES),
    )
    parser.add_argument(
        "--duration",
        type=float,
        help="seconds of arrivals at the reference rate (--rate, --size-for, else "
        "--start-rate), which fix the request count of every rate (default 600; for "
        "--paper-table, sets every scenario's)",
    )
    parser.add_argument(
        "--same-window",
        action="store_true",
        help="every replica count replays the largest count's requests (--duration x the "
        "reference rate x the largest --replicas), so the scaling factors compare the same "
        "requests; by default each count replays its own replicas' worth",
    )
    parser.add_argument(
        "--arrivals", choices=("poisson", "trace"), help="default poisson (trace: --paper-table)"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        help="trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens: an Azure file or a log of "
        "your own in its format) every scenario's trace arrivals replay (default: each "
        f"scenario's Azure trace in {TRACE_DIR}, a mix's `trace`)",
    )
    parser.add_argument(
        "--start-rate",
        type=float,
        help="capacity search start, req/s per replica, within [--min-rate, --max-rate] "
        "(default: the scenario's START_RATES, moved into that range)",
    )
    parser.add_argument(
        "--rel-tol", type=float, help="capacity search tolerance, in (0, 1] (default 0.05)"
    )
    parser.add_argument(
        "--min-rate",
        type=float,
        help='capacity search floor: failing there reports capacity 0, a bound ("<FLOOR" in '
        "the table) left out of the ratios",
    )
    parser.add_argument(
        "--max-rate",
        type=float,
        help="capacity search ceiling: passing there reports it as the capacity, a bound "
        '(">=CEILING" in the table) left out of the ratios',
    )
    parser.add_argument(
        "--baseline-profile",
        help="profile (name or path) of the replicas that run no draft model: vllm, sarathi, "
        "distserve, slos-nospec (default: --profile; give the no-draft profile when --profile "
        "was measured with a draft, e.g. cpu-demo-nodraft beside cpu-demo)",
    )
    parser.add_argument(
        "--replica-slowdown",
        type=float,
        default=1.0,
        help="simulated replicas take this many times the profile's step time, while every "
        "planner still believes the profile (a loaded live machine; default 1)",
    )
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="and this much more per step (a serving loop's cost outside the model; default 0)",
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply every request length, as slos-serve loadgen --length-scale (default 1)",
    )
    parser.add_argument(
        "--zero-load",
        type=Path,
        help="a slos-serve loadgen --json output (or its zero_load object): zero-load TTFT and "
        "the TPOT tiers come from its measured numbers, as in that live run (default: from "
        "the profile, GPU TPOT levels)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=positive_int,
        help="KV cache blocks (16 tokens) per replica, for a profile without kv_capacity_tokens "
        f"(default {DEFAULT_KV_BLOCKS})",
    )
    parser.add_argument("--tick-ms", type=positive_float, default=10.0)
    parser.add_argument("--route-limit", type=positive_int, default=2)
    parser.add_argument(
        "--acceptance",
        type=unit_interval,
        default=DEFAULT_ACCEPTANCE,
        help="the draft's per-token acceptance in the simulated engine (default "
        f"{DEFAULT_ACCEPTANCE})",
    )
    parser.add_argument(
        "--acceptance-spread",
        type=unit_interval,
        default=0.0,
        help="each request's own acceptance is drawn uniformly within this of --acceptance "
        "(default 0: every request alike); where requests differ, slos+goodspeed re-splits "
        "the drafts toward the ones that accept",
    )
    parser.add_argument(
        "--draft-confidence",
        type=positive_float,
        metavar="CONCENTRATION",
        help="the simulated draft says how sure it is of each token: a confidence drawn from "
        "a Beta law of mean the request's acceptance and this concentration (smaller: more "
        "telling), accepted with that probability, for every policy; slos+specserve needs "
        "it (default: no confidences)",
    )
    parser.add_argument(
        "--sibling-acceptance",
        type=unit_intervals,
        metavar="S2,S3,...",
        help="slos+adaserve: the chance the target takes the draft's second, third, ... choice "
        "given it took none before (the last value for every later rank; default "
        f"{','.join(map(str, DEFAULT_SIBLINGS))}, the demo pair's, `slos-serve bench adaserve`)",
    )
    parser.add_argument(
        "--tree-width",
        type=positive_int,
        help="slos+adaserve: the most children a token tree keeps per level "
        f"(cluster.adaserve.max_width; default {AdaServeConfig.max_width}; the budget's width "
        "is at most 3 under 4 drafts a request, so only 1 or 2 narrows it)",
    )
    parser.add_argument(
        "--tree-nodes",
        type=positive_int,
        help="slos+adaserve: nodes one request may verify in a step (cluster.adaserve.max_nodes; "
        f"default {AdaServeConfig.max_nodes})",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="every replica keeps the prompts and outputs it computed for later requests that "
        "start with the same tokens (a mix's system prompts, a session's history), as "
        "cluster.prefix_caching does live; slos+prefix routes by it",
    )
    parser.add_argument(
        "--no-prefix-credit",
        dest="credit_prefixes",
        action="store_false",
        help="with --prefix-caching: plan and price every prefill in full, learning of a "
        "cached prefix only as it runs (by default each scheduler counts the prefix a new "
        "request finds cached as computed, as cluster.credit_prefixes does live)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--json", type=output_file, help="write results here")
    parser.add_argument(
        "--plot",
        type=plot_file,
        help="image path (its suffix picks the format: .png, .svg, .pdf, .jpg; none: .png): "
        "PATH = attainment vs rate (capacities marked); PATH-capacity.png = capacity bars "
        "(capacity runs); PATH-timeline.png = burst timeline of one run",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run this many capacity searches (with --rate: runs) at once, in worker "
        "processes; 0 = one per CPU (default 1). Every run is deterministic, so the results "
        "are the same as one at a time",
    )
    parser.add_argument(
        "--timeline-scenario",
        help="scenario of the burst timeline (default: the first; coder for --paper-table); "
        "it runs at --rate, else at slos's capacity",
    )


def _parse_list(option: str, text: str, parse: Callable[[str], T], known: str | None) -> list[T]:
    """A comma list, each item parsed; errors name the option and the bad item (`known`: what
    the item should be; None: the parser's own message says it)."""
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise OptionError(f"{option} is empty")
    if not all(items):
        raise OptionError(f"{option}: an empty item in {text!r}")
    out: list[T] = []
    for item in items:
        try:
            value = parse(item)
        except ValueError as exc:
            detail = exc if known is None else f"{item!r} is not {known}"
            raise OptionError(f"{option}: {detail}") from None
        if value in out:
            raise OptionError(f"{option}: {item!r} repeats an earlier item")
        out.append(value)
    return out


def _traces(p: Plan) -> dict[str, Any]:
    """What trace arrivals replayed, per workload, with the data's attribution."""
    if p.arrivals != "trace":
        return {}
    traces = {s.value: read_trace(p.trace or trace_path(s)) for s in p.scenarios}
    return {
        "traces": {
            label: {"file": t.name, "requests": len(t.rows), "attribution": t.attribution}
            for label, t in traces.items()
        }
    }


def _credit(traces: Mapping[str, Any]) -> str:
    """What the figures credit for `_traces`' arrivals (their licence asks for attribution);
    "" for none, or only traces of the user's own."""
    attributions = dict.fromkeys(
        t["attribution"] for t in traces.get("traces", {}).values() if t["attribution"]
    )
    return "arrivals: " + "; ".join(attributions) if attributions else ""


def _mixes(scenarios: Sequence[Workload]) -> dict[str, Any]:
    """The run's mix files as the JSON's `mixes`, by label (nothing when it ran none)."""
    mixes = {s.value: s.to_dict() for s in scenarios if not isinstance(s, Scenario)}
    return {"mixes": mixes} if mixes else {}


def _workloads(text: str) -> list[Workload]:
    """--scenario's comma list: scenario names and mix files, each label once."""
    out: list[Workload] = _parse_list("--scenario", text, parse_workload, None)
    labels = [w.value for w in out]
    if len(set(labels)) != len(labels):
        raise OptionError(f"--scenario: the workloads' names repeat: {labels}")
    return out


def _total_rate(text: str) -> float:
    rate = float(text)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(text)
    return rate


def _replica_count(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


@dataclass(frozen=True)
class Plan:
    """What one invocation runs, after defaults and --paper-table / --ablation."""

    profile: str
    scenarios: list[Workload]
    policies: list[Policy]
    replica_counts: list[int]
    rate: float | None
    """Attainment at this rate; None = capacity search (or sizing)."""
    size_for: list[float]
    """Sizing: the fewest replicas for each of these requests per second in all (empty: no
    sizing)."""
    max_replicas: int
    min_rate: float
    max_rate: float
    """A capacity search's floor and ceiling."""
    duration_s: float
    scenario_durations_s: dict[Workload, float]
    """Seconds of arrivals per scenario (`duration_s` unless --paper-table lengthens it)."""
    arrivals: str
    rel_tol: float
    start_rates: dict[Workload, float]
    timeline_scenario: Workload
    same_window: bool
    """Every replica count replays the largest count's requests (--same-window)."""
    baseline_profile: str | None
    slowdown: Slowdown
    length_scale: float
    zero_load: ZeroLoad | None
    trace: Path | None
    """--trace, resolved and read (None: each workload's own trace)."""
    stop_below: float | None
    """Where a search's runs stop early (None with --rate or --full-runs)."""
    jobs: int
    """Worker processes (1: the runs in this process, in order)."""
    autoscale: list[ScaleChoice]
    """With --size-for: the autoscalers each fixed count is compared with."""
    replica_startup_s: float
    adaserve: AdaServeConfig
    """slos+adaserve's tree constants (--tree-width, --tree-nodes)."""
    sibling_acceptance: tuple[float, ...]
    """slos+adaserve's later draft choices (--sibling-acceptance)."""

    def requests_per_replica(self, scenario: Workload) -> int:
        """Requests a replica gets at every rate: the scenario's duration at the reference rate
        (`--rate`, else the search's start)."""
        reference = self.rate if self.rate is not None else self.start_rates[scenario]
        return max(1, round(reference * self.scenario_durations_s[scenario]))


SEARCH_OPTIONS = ("start_rate", "rel_tol", "min_rate", "max_rate", "full_runs")
"""Options of a search (--capacity, --size-for), which a run at one --rate would ignore."""


def _check_search_options(args: argparse.Namespace, size_for: list[float]) -> None:
    """An option the run would ignore is refused: it says the user expects something else."""
    given = [n for n in SEARCH_OPTIONS if getattr(args, n) not in (None, False)]
    if args.rate is not None and given:
        flag = "--" + given[0].replace("_", "-")
        raise OptionError(f"{flag} applies to a search (--capacity, --size-for), not --rate")
    if args.max_replicas is not None and not size_for:
        raise OptionError("--max-replicas applies to --size-for only")
    if args.autoscale is not None and not size_for:
        raise OptionError("--autoscale compares with a fixed count: it applies to --size-for only")
    if args.replica_startup_s is not None and args.autoscale is None:
        raise OptionError("--replica-startup-s applies to --autoscale only")
    if args.timeline_scenario is not None and args.plot is None:
        raise OptionError("--timeline-scenario picks a plot's timeline: give --plot too")


def plan(args: argparse.Namespace) -> Plan:
    """Resolve the options; a conflict or a bad value raises OptionError naming the option."""
    paper = args.paper_table
    if paper:
        for name in PAPER_FIXED:
            if getattr(args, name) not in (None, False):
                flag = "--" + name.replace("_", "-")
                raise OptionError(f"--paper-table sets {flag} itself; drop {flag}")
    if args.ablation and args.policies is not None:
        raise OptionError("--ablation sets --policies itself; drop --policies")
    size_for = (
        []
        if args.size_for is None
        else _parse_list("--size-for", args.size_for, _total_rate, "a rate > 0")
    )
    if size_for:
        for name in ("replicas", "same_window"):
            if getattr(args, name) not in (None, False):
                flag = "--" + name.replace("_", "-")
                raise OptionError(f"--size-for searches the replica count itself; drop {flag}")
    _check_search_options(args, size_for)
    max_replicas = 64 if args.max_replicas is None else args.max_replicas
    if isinstance(max_replicas, bool) or max_replicas < 1:
        raise OptionError(f"--max-replicas must be >= 1, got {max_replicas!r}")
    scenarios: list[Workload] = (
        list(Scenario)
        if paper
        else _workloads(Scenario.CHATBOT.value if args.scenario is None else args.scenario)
    )
    if paper:
        policies = list(PAPER_POLICIES)
    elif args.ablation:
        policies = list(ABLATION_POLICIES)
    else:
        policies = _parse_list(
            "--policies",
            "slos,vllm,sarathi" if args.policies is None else args.policies,
            Policy,
            f"a policy ({', '.join(policy.value for policy in Policy)})",
        )
    if Policy.SLOS_SPECSERVE in policies and args.draft_confidence is None:
        raise OptionError(
            "--policies slos+specserve drafts by the draft's confidences: give --draft-confidence"
        )
    if Policy.SLOS_PREFIX in policies and not args.prefix_caching:
        raise OptionError(
            "--policies slos+prefix routes by the replicas' caches: give --prefix-caching"
        )
    autoscale = [] if args.autoscale is None else parse_choices(args.autoscale)
    if autoscale and Policy.DISTSERVE in policies:
        raise OptionError("--autoscale: distserve's pools are simulated at a fixed size")
    for choice in autoscale:
        if not any(choice.applies_to(policy) for policy in policies):
            raise OptionError(
                f"--autoscale {choice.label} follows admission's declines, and none of "
                "--policies declines (give a slos policy, or use ongoing:TARGET)"
            )
    startup = args.replica_startup_s
    if startup is None:
        startup = SimConfig.replica_startup_s
    if not (math.isfinite(startup) and startup >= 0):
        raise OptionError(f"--replica-startup-s must be >= 0, got {startup!r}")
    if Policy.DISTSERVE in policies and args.prefix_caching:
        raise OptionError("--prefix-caching: distserve is simulated without prefix caching")
    if not args.credit_prefixes and not args.prefix_caching:
        raise OptionError("--no-prefix-credit applies to --prefix-caching only")
    if Policy.SLOS_ADASERVE not in policies:
        for name in ("tree_width", "tree_nodes", "sibling_acceptance"):
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise OptionError(f"{flag} applies to --policies slos+adaserve only")
    if args.draft_confidence is not None and not 1e-3 <= args.draft_confidence <= 1e6:
        raise OptionError(
            f"--draft-confidence must be in [0.001, 1e6], got {args.draft_confidence}"
        )
    replica_counts = _parse_list(
        "--replicas",
        "1" if args.replicas is None else args.replicas,
        _replica_count,
        "a replica count >= 1",
    )
    if args.same_window and len(set(replica_counts)) < 2:
        raise OptionError("--same-window compares replica counts; --replicas needs two or more")
    for name in (
        "rate",
        "duration",
        "start_rate",
        "min_rate",
        "max_rate",
        "replica_slowdown",
        "length_scale",
    ):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise OptionError(f"--{name.replace('_', '-')} must be > 0, got {value!r}")
    if args.rel_tol is not None:
        try:
            check_rel_tol("--rel-tol", args.rel_tol)
        except ValueError as exc:
            raise OptionError(str(exc)) from None
    overhead = args.step_overhead_ms
    if not (math.isfinite(overhead) and overhead >= 0):
        raise OptionError(f"--step-overhead-ms must be >= 0, got {overhead!r}")
    try:
        zero_load = ZeroLoad.load(args.zero_load) if args.zero_load is not None else None
    except ValueError as exc:
        raise OptionError(f"--zero-load: {exc}") from None
    if args.start_rate is not None:
        start_rates = dict.fromkeys(scenarios, args.start_rate)
    else:
        start_rates = {
            s: START_RATES[s] if isinstance(s, Scenario) else MIX_START_RATE for s in scenarios
        }
    arrivals = args.arrivals or ("trace" if paper else "poisson")
    trace = None
    if args.trace is not None:
        if arrivals != "trace":
            raise OptionError(f"--trace applies to --arrivals trace only, not {arrivals}")
        trace = args.trace.resolve()
        try:
            read_trace(trace)
        except ValueError as exc:
            raise OptionError(f"--trace: {exc}") from None
    if args.jobs < 0:
        raise OptionError(f"--jobs must be >= 0 (0: one per CPU), got {args.jobs}")
    min_rate = 1e-3 if args.min_rate is None else args.min_rate
    max_rate = 1e4 if args.max_rate is None else args.max_rate
    if min_rate > max_rate:
        raise OptionError(f"--min-rate {min_rate} exceeds --max-rate {max_rate}")
    if args.start_rate is not None and not min_rate <= args.start_rate <= max_rate:
        raise OptionError(
            f"--start-rate {args.start_rate:g} lies outside the search's range [--min-rate "
            f"{min_rate:g}, --max-rate {max_rate:g}]: give a start within it"
        )
    # A default start (the scenario's) moves into the range the user gave.
    start_rates = {s: min(max(r, min_rate), max_rate) for s, r in start_rates.items()}
    duration = args.duration or (PAPER_DURATION_S if paper else 600.0)
    timeline: Workload = Scenario.CODER if paper else scenarios[0]
    if args.timeline_scenario is not None:
        by_label = {s.value: s for s in scenarios}
        if args.timeline_scenario not in by_label:
            raise OptionError(
                f"--timeline-scenario must be one of the run's scenarios {list(by_label)}, "
                f"got {args.timeline_scenario!r}"
            )
        timeline = by_label[args.timeline_scenario]
    return Plan(
        profile=args.profile or DEFAULT_PROFILE,
        scenarios=scenarios,
        policies=policies,
        replica_counts=replica_counts,
        rate=args.rate,
        size_for=size_for,
        max_replicas=max_replicas,
        min_rate=min_rate,
        max_rate=max_rate,
        duration_s=duration,
        scenario_durations_s={
            s: PAPER_DURATIONS_S.get(s, duration) if paper and not args.duration else duration
            for s in scenarios
        },
        arrivals=arrivals,
        rel_tol=args.rel_tol or (PAPER_REL_TOL if paper else 0.05),
        start_rates=start_rates,
        timeline_scenario=timeline,
        same_window=args.same_window,
        baseline_profile=args.baseline_profile,
        slowdown=Slowdown(args.replica_slowdown, overhead / 1e3),
        length_scale=args.length_scale,
        zero_load=zero_load,
        trace=trace,
        stop_below=None if args.rate is not None or args.full_runs else DEFAULT_TARGET,
        jobs=args.jobs or os.cpu_count() or 1,
        autoscale=autoscale,
        replica_startup_s=startup,
        adaserve=AdaServeConfig(
            max_width=args.tree_width or AdaServeConfig.max_width,
            max_nodes=args.tree_nodes or AdaServeConfig.max_nodes,
        ),
        sibling_acceptance=args.sibling_acceptance or DEFAULT_SIBLINGS,
    )


def run(args: argparse.Namespace) -> int:
    p = plan(args)
    perf = load_profile("--profile", p.profile)
    baseline = p.baseline_profile
    baseline_perf = load_profile("--baseline-profile", baseline) if baseline else None
    if baseline_perf is not None and baseline_perf.tp != perf.tp:
        raise OptionError(
            f"--baseline-profile is for tensor parallelism {baseline_perf.tp} and --profile for "
            f"{perf.tp}: the policies would run on different replicas"
        )
    if Policy.DISTSERVE in p.policies:
        try:  # before any run, not after the other policies' runs
            kv_bytes_per_token(baseline_perf or perf)
        except ValueError as exc:
            raise OptionError(
                f"--policies distserve: profile {baseline or p.profile!r}: {exc}"
            ) from None
    num_kv_blocks = kv_blocks(perf, args.kv_blocks)

    def setup(scenario: Workload, requests_per_replica: int, window: int | None) -> Setup:
        return Setup(
            perf,
            scenario,
            p.arrivals,
            requests_per_replica,
            args.seed,
            num_kv_blocks,
            args.tick_ms / 1e3,
            args.route_limit,
            acceptance=args.acceptance,
            acceptance_spread=args.acceptance_spread,
            confidence_concentration=args.draft_confidence,
            sibling_acceptance=p.sibling_acceptance,
            adaserve=p.adaserve,
            window_replicas=window,
            baseline_perf=baseline_perf,
            slowdown=p.slowdown,
            length_scale=p.length_scale,
            zero_load=p.zero_load,
            trace=p.trace,
            stop_below=p.stop_below,
            prefix_caching=args.prefix_caching,
            credit_prefixes=args.credit_prefixes,
        )

    traces = _traces(p)
    out: dict[str, Any] = {
        "profile": p.profile,
        "baseline_profile": p.baseline_profile or p.profile,
        "replica_slowdown": asdict(p.slowdown),
        "length_scale": p.length_scale,
        "prefix_caching": args.prefix_caching,
        "credit_prefixes": args.prefix_caching and args.credit_prefixes,
        "zero_load": p.zero_load.to_dict() if p.zero_load is not None else None,
        "paper_table": args.paper_table,
        "arrivals": p.arrivals,
        **traces,
        "duration_s": p.duration_s,
        "scenario_duration_s": {s.value: d for s, d in p.scenario_durations_s.items()},
        **_mixes(p.scenarios),
        "rel_tol": p.rel_tol,
        "seed": args.seed,
        "acceptance": args.acceptance,
        "acceptance_spread": args.acceptance_spread,
        "draft_confidence": args.draft_confidence,
        "sibling_acceptance": list(p.sibling_acceptance),
        "adaserve": asdict(p.adaserve),
        "same_window": p.same_window,
        "stop_below": p.stop_below,
        "compiled_planner": compiled.active(),
    }

    def save(part: Mapping[str, Any]) -> None:
        """Write the JSON (the header and `part`), when asked for."""
        if args.json is not None:
            args.json.write_text(json.dumps({**out, **part}, indent=2) + "\n")

    if p.size_for:
        out |= _size(p, setup, perf.tp, Figures(args.plot, _credit(traces)), save)
    else:
        setups = {
            s: setup(
                s,
                p.requests_per_replica(s),
                max(p.replica_counts) if p.same_window else None,
            )
            for s in p.scenarios
        }
        out |= _capacities(p, setups, Figures(args.plot, _credit(traces)), save)
    save({})
    return 0


STARTUPS_PER_WINDOW = 5
"""An autoscaled window shorter than this many replica start-ups warns: its added replicas
start as the arrivals end (sizing QA: 60 s with a 60 s start, 41-82% more replica time for
the same attainment)."""

Save = Callable[[Mapping[str, Any]], None]
"""Writes the results so far (`run`'s `save`): before the figures are drawn, so a figure that
fails loses none of them."""


@dataclass(frozen=True)
class Figures:
    """Where the figures go (--plot; None: none drawn) and what they credit (`_credit`)."""

    path: Path | None
    credit: str


def _capacities(
    p: Plan, setups: Mapping[Workload, Setup], figures: Figures, save: Save
) -> dict[str, Any]:
    """Every (scenario, policy, replica count)'s run at --rate, or its capacity search: the
    output's requests, work bounds, runs, summary and plots."""
    out: dict[str, Any] = {
        "requests": {
            s.value: {str(n): setup.requests(n) for n in p.replica_counts}
            for s, setup in setups.items()
        },
        "work_bound": {
            s.value: {str(n): _work_bound(setup, n) for n in p.replica_counts}
            for s, setup in setups.items()
        },
    }
    for setup in setups.values():
        for warning in setup.tpots_under_a_step():
            print(warning)
    runs: list[dict[str, Any]] = []
    capacity: dict[str, dict[str, dict[str, float]]] = {}
    bounds: dict[str, dict[str, dict[str, Bound]]] = {}
    searches: list[dict[str, Any]] = []
    warnings: list[str] = []
    _print_run_header()
    jobs = [
        Job(s, policy, n) for s in p.scenarios for policy in p.policies for n in p.replica_counts
    ]
    search = partial(find_capacity, rel_tol=p.rel_tol, min_rate=p.min_rate, max_rate=p.max_rate)
    calls = [(setups[j.scenario], j, p.rate, p.start_rates[j.scenario], search) for j in jobs]
    # In job order whatever order they finish in, so the JSON is the same for every --jobs.
    for job, (job_runs, found) in zip(
        jobs, _run_jobs(jobs, run_job, calls, _print_capacity, p.jobs), strict=True
    ):
        runs += job_runs
        if found is None:
            continue
        scenario, policy, n = job.scenario.value, job.policy.value, str(job.replicas)
        capacity.setdefault(scenario, {}).setdefault(policy, {})[n] = found.capacity
        if found.bound is not None:
            bounds.setdefault(scenario, {}).setdefault(policy, {})[n] = found.bound
        at = _capacity_run(job_runs, found)
        searches.append(
            {"scenario": scenario, "policy": policy, "replicas": job.replicas}
            | found.to_dict()
            | {"sustained": None if at is None else at["sustained"]}
        )
        if at is not None and not at["sustained"]:
            warnings.append(_not_sustained(job, at))
    out["runs"] = runs
    if p.rate is None:
        out["capacity_searches"] = searches
        out["summary"] = summarize(capacity, bounds)
        print(markdown_tables(out["summary"]))
        for warning in warnings:
            print(warning)
    if figures.path is not None:
        save(out)
        timeline = setups[p.timeline_scenario]
        out["plots"] = _plot(figures.path, figures.credit, p, timeline, runs, capacity, bounds, out)
    return out


def _capacity_run(
    runs: Sequence[Mapping[str, Any]], found: CapacityResult
) -> Mapping[str, Any] | None:
    """The run of a search at its capacity (None when nothing passed)."""
    if found.capacity == 0.0:
        return None
    return [r for r in runs if r["rate_per_replica"] == found.capacity][-1]


def _not_sustained(job: Job, at: Mapping[str, Any]) -> str:
    """The warning for a capacity whose run served its requests long after they arrived."""
    return (
        f"warning: {job.scenario.value} {job.policy.value} x{job.replicas}: capacity "
        f"{at['rate_per_replica']:.3g} req/s per replica is not sustained: its "
        f"{at['report']['overall']['requests']} requests arrived within "
        f"{at['arrival_window_s']:.3g} s and took {at['backlog_s']:.3g} s more to finish (a "
        "backlog batched after the arrivals stopped); lengthen --duration for more requests "
        "per point"
    )


def _size(
    p: Plan,
    setup: Callable[[Workload, int, int | None], Setup],
    gpus_per_replica: int,
    figures: Figures,
    save: Save,
) -> dict[str, Any]:
    """Every (scenario, total rate, policy)'s sizing search: the output's requests, work
    bounds, runs, sizing, summary and plots. Each (scenario, rate) replays the rate's
    duration of requests on every replica count (`window_replicas` 1: counted in all)."""
    setups = {
        (s, rate): setup(s, max(1, round(rate * p.scenario_durations_s[s])), 1)
        for s in p.scenarios
        for rate in p.size_for
    }
    bounds = {(s, rate): _sizing_bound(one, rate) for (s, rate), one in setups.items()}
    out: dict[str, Any] = {
        "size_for": p.size_for,
        "max_replicas": p.max_replicas,
        "requests": _by_scenario_and_rate({k: one.requests(1) for k, one in setups.items()}),
        "work_bound": _by_scenario_and_rate(bounds),
    }
    _print_run_header()
    calls = [
        (
            one,
            Job(s, policy, _sizing_start(p, policy, int(bounds[s, rate]["replicas"])), rate),
            p.max_replicas,
            p.autoscale,
            p.replica_startup_s,
        )
        for (s, rate), one in setups.items()
        for policy in p.policies
    ]
    jobs = [call[1] for call in calls]
    runs: list[dict[str, Any]] = []
    scaled: list[dict[str, Any]] = []
    sizing: dict[str, dict[str, dict[str, SizingResult]]] = {}
    results = _run_jobs(jobs, size_job, calls, _print_sizing, p.jobs)
    for job, (job_runs, sized, job_scaled) in zip(jobs, results, strict=True):
        assert job.total_rate is not None
        runs += job_runs
        scaled += job_scaled
        by_rate = sizing.setdefault(job.scenario.value, {})
        by_rate.setdefault(rate_key(job.total_rate), {})[job.policy.value] = sized
    out["runs"] = runs
    out["sizing"] = {
        s: {rate: {policy: r.to_dict() for policy, r in by.items()} for rate, by in by_rate.items()}
        for s, by_rate in sizing.items()
    }
    fewest = _by_scenario_and_rate({k: int(b["replicas"]) for k, b in bounds.items()})
    out["summary"] = summarize_sizing(sizing, p.max_replicas, gpus_per_replica, fewest)
    print(sizing_table(out["summary"]))
    if p.autoscale:
        out["autoscale"] = {"replica_startup_s": p.replica_startup_s, "runs": scaled}
        out["summary"]["autoscaled"] = autoscale_summary(scaled)
        print(autoscale_table(scaled))
        for scenario, duration in p.scenario_durations_s.items():
            if duration < STARTUPS_PER_WINDOW * p.replica_startup_s:
                print(
                    f"warning: {scenario.value}: a replica the autoscaler adds serves "
                    f"{p.replica_startup_s:g} s after it is asked for, in a {duration:g} s "
                    "window: what it adds late counts in the replicas it ran, with little "
                    "left to serve (lengthen --duration)"
                )
    if figures.path is not None:
        save(out)
        paths = figure_paths(figures.path)
        plot_sizing(sizing_panels(runs, sizing), paths["attainment"], credit=figures.credit)
        written = {"sizing": paths["attainment"]}
        if len(p.size_for) > 1:
            plot_replicas_needed(replicas_needed(sizing), paths["replicas"], figures.credit)
            written["replicas"] = paths["replicas"]
        for name, where in written.items():
            print(f"plot {name}: {where}")
        out["plots"] = {name: str(where) for name, where in written.items()}
    return out


def _by_scenario_and_rate(values: Mapping[tuple[Workload, float], T]) -> dict[str, dict[str, T]]:
    out: dict[str, dict[str, T]] = {}
    for (scenario, rate), value in values.items():
        out.setdefault(scenario.value, {})[rate_key(rate)] = value
    return out


def _print_run_header() -> None:
    print(
        f"{'scenario':<11} {'policy':<15}{'replicas':>8}{'rate/rep':>10}{'attain':>8}{'wall s':>8}"
    )


@dataclass(frozen=True)
class Job:
    """One capacity search of the command (with --rate, one run; with --size-for, one search
    of the replica count)."""

    scenario: Workload
    policy: Policy
    replicas: int
    """The replica count; with --size-for, where the search starts."""
    total_rate: float | None = None
    """With --size-for: the requests per second in all the count is searched for."""


Search = Callable[[Callable[[float], float], float], CapacityResult]
"""`find_capacity` with the command's tolerance and bounds: (attainment at a rate, start)."""

JobResult = tuple[list[dict[str, Any]], CapacityResult | None]
"""A job's runs, in the order they ran, and its search's result (None with --rate)."""


def run_job(
    setup: Setup, job: Job, rate: float | None, start_rate: float, search: Search
) -> JobResult:
    """Run one job (in a worker process with --jobs): a top-level function so it pickles."""
    runs: list[dict[str, Any]] = []
    attainment = partial(_evaluate, setup, job.policy, job.replicas, runs)
    if rate is not None:
        attainment(rate)
        return runs, None
    return runs, search(attainment, start_rate)


SizeResult = tuple[list[dict[str, Any]], SizingResult, list[dict[str, Any]]]
"""A sizing job's runs, its search's result and its autoscaled runs (`--autoscale`)."""


def size_job(
    setup: Setup,
    job: Job,
    most: int,
    choices: Sequence[ScaleChoice],
    startup_s: float,
) -> SizeResult:
    """Search the fewest replicas for the job's total rate, then replay its requests under
    each autoscaler from that count (in a worker process with --jobs)."""
    assert job.total_rate is not None
    total_rate = job.total_rate
    runs: list[dict[str, Any]] = []

    def attainment(n: int) -> float:
        return _evaluate(setup, job.policy, n, runs, total_rate / n)

    least = _least_replicas(job.policy)
    found = find_replicas(attainment, job.replicas, least=least, most=max(most, least))
    for r in runs:
        r["total_rate"] = total_rate
    fixed = found.replicas
    scaled = [
        _autoscaled(setup, job.policy, total_rate, fixed, choice, startup_s)
        for choice in choices
        if fixed is not None and choice.applies_to(job.policy)
    ]
    return runs, found, scaled


def _autoscaled(
    setup: Setup,
    policy: Policy,
    total_rate: float,
    fixed: int,
    choice: ScaleChoice,
    startup_s: float,
) -> dict[str, Any]:
    """The sizing's requests from `fixed` replicas, the count left to `choice`'s autoscaler;
    run to the end (its GPU time is the point)."""
    config = replace(
        setup.config(policy, fixed),
        autoscale=choice.config(fixed),
        replica_startup_s=startup_s,
        stop_below=None,
    )
    workload = setup.workload(total_rate / fixed, fixed)
    run_report, result, _ = simulate_workload(setup.perf_for(policy), workload, config)
    assert run_report is not None
    value = run_report.overall.attainment
    tqdm.write(
        f"  autoscaled {setup.scenario.value} {policy.value} {total_rate:g} req/s "
        f"{choice.label}: attainment {value:.3f}, {result.mean_replicas:.2f} replicas on "
        f"average (fixed {fixed}; {result.wall_s:.1f} s)"
    )
    run = {"scenario": setup.scenario.value, "policy": policy.value, "total_rate": total_rate}
    return scaled_run(run | {"attainment": value}, choice, fixed, result)


def _least_replicas(policy: Policy) -> int:
    """distserve needs a prefill and a decode replica."""
    return 2 if policy is Policy.DISTSERVE else 1


def _sizing_start(p: Plan, policy: Policy, fewest: int) -> int:
    """Where a sizing search starts: the `fewest` replicas the work bound allows any
    non-speculating policy (speculation may pass below it, and the search then goes down),
    within the search's limits."""
    least = _least_replicas(policy)
    return min(max(fewest, least), max(p.max_replicas, least))


def _run_jobs(
    jobs: Sequence[Job],
    work: Callable[..., R],
    calls: Sequence[tuple[Any, ...]],
    report: Callable[[Job, R], None],
    workers: int,
) -> list[R]:
    """`work(*call)` for every job's call, in job order, at most `workers` at once."""
    results: dict[int, R] = {}
    with tqdm(total=len(jobs), unit="job", disable=None, leave=False) as bar:

        def done(i: int, result: R) -> None:
            results[i] = result
            report(jobs[i], result)
            bar.update()

        if min(workers, len(jobs)) <= 1:
            for i, (job, call) in enumerate(zip(jobs, calls, strict=True)):
                bar.set_postfix_str(f"{job.scenario.value} {job.policy.value} x{job.replicas}")
                done(i, work(*call))
        else:
            # spawn: the parent's threads (tqdm's monitor) must not be forked mid-lock. A
            # pool that terminates its workers on the way out, so that Ctrl-C (or a failed
            # job) stops the command at once: an executor waited for every queued job.
            context = multiprocessing.get_context("spawn")
            items = [(i, work, call) for i, call in enumerate(calls)]
            with context.Pool(min(workers, len(jobs)), _ignore_ctrl_c) as pool:
                for i, result in pool.imap_unordered(_indexed, items):
                    done(i, result)
                # All done: the workers end on their own. Terminating them, the way out on
                # Ctrl-C or a failure, leaves a resource-tracker warning about semaphores.
                pool.close()
                pool.join()
    return [results[i] for i in range(len(jobs))]


def _ignore_ctrl_c() -> None:
    """A worker leaves Ctrl-C to the command, which stops it (each printed a traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _indexed(item: tuple[int, Callable[..., R], tuple[Any, ...]]) -> tuple[int, R]:
    """A worker's job: `work(*call)`, with the job's index."""
    i, work, call = item
    return i, work(*call)


def _print_capacity(job: Job, result: JobResult) -> None:
    found = result[1]
    if found is not None:
        tqdm.write(
            f"  capacity {job.scenario.value} {job.policy.value} x{job.replicas}: "
            f"{found.capacity:.3f}"
        )


def _print_sizing(job: Job, result: SizeResult) -> None:
    n = result[1].replicas
    tqdm.write(
        f"  replicas {job.scenario.value} {job.policy.value} for {job.total_rate:g} req/s: "
        + (f"{n}" if n is not None else f"none up to the ceiling ({result[1].largest_failing})")
    )


def timeline_rate(
    capacity: Mapping[str, Mapping[str, Mapping[str, float]]], scenario: Workload, replicas: int
) -> float | None:
    """slos's capacity in the scenario (else the highest capacity found): the load slos just
    holds, where the baselines' behavior under bursts shows; None when every search found 0."""
    by_policy = capacity.get(scenario.value, {})
    found = by_policy.get(Policy.SLOS.value, {}).get(str(replicas))
    if not found:
        found = max((c.get(str(replicas), 0.0) for c in by_policy.values()), default=0.0)
    return found or None


def _plot(
    path: Path,
    credit: str,
    p: Plan,
    setup: Setup,
    runs: list[dict[str, Any]],
    capacity: dict[str, dict[str, dict[str, float]]],
    bounds: Bounds,
    out: dict[str, Any],
) -> dict[str, str]:
    """Draw the figures; the timeline's data goes into `out` too. Returns name -> path."""
    paths = figure_paths(path)
    written = {}
    plot_attainment(attainment_panels(runs, capacity, bounds), paths["attainment"], credit=credit)
    written["attainment"] = paths["attainment"]
    if capacity:
        plot_capacity(capacity_bars(capacity, bounds), paths["capacity"], credit)
        written["capacity"] = paths["capacity"]
    replicas = p.replica_counts[0]
    rate = p.rate if p.rate is not None else timeline_rate(capacity, setup.scenario, replicas)
    policies = [policy for policy in p.policies if policy is not Policy.DISTSERVE]
    if rate is None or not policies:
        print("no timeline: every capacity search found 0, or only distserve ran")
    else:
        bin_s = max(1.0, setup.requests(replicas) / (rate * replicas) / 120)
        timelines = {
            policy.value: burst_timeline(_records(setup, policy, replicas, rate), bin_s)
            for policy in policies
        }
        title = f"{setup.scenario.value}, {p.arrivals} arrivals, {rate:.3g} req/s x{replicas}"
        plot_timelines(timelines, title, paths["timeline"], credit)
        written["timeline"] = paths["timeline"]
        out["timeline"] = {
            "scenario": setup.scenario.value,
            "replicas": replicas,
            "rate_per_replica": rate,
            "policies": {k: asdict(v) for k, v in timelines.items()},
        }
    for name, where in written.items():
        print(f"plot {name}: {where}")
    return {name: str(where) for name, where in written.items()}


def _work_bound(setup: Setup, replicas: int) -> dict[str, float]:
    """`Setup.work_bound` as JSON, printed."""
    least_ms, rate = setup.work_bound(replicas)
    print(
        f"work bound {setup.scenario.value} x{replicas}: {least_ms:.2f} ms of replica time a "
        f"request without speculation, so at most {rate:.3g} req/s per replica sustained"
    )
    return {"ms_per_request": least_ms, "rate_per_replica": rate}


def _sizing_bound(setup: Setup, total_rate: float) -> dict[str, float]:
    """`_work_bound` of a sizing search, with the fewest replicas it allows `total_rate`
    without speculation; printed."""
    bound = _work_bound(setup, 1)
    fewest = math.ceil(total_rate / bound["rate_per_replica"])
    print(f"  so at least {fewest} replica(s) for {total_rate:g} req/s")
    for warning in setup.tpots_under_a_step():
        print(warning)
    return bound | {"replicas": fewest}


def _records(setup: Setup, policy: Policy, replicas: int, rate: float) -> list[RequestRecord]:
    """Every request's record of a whole run (never stopped early: a timeline shows it all)."""
    workload = setup.workload(rate, replicas)
    config = replace(setup.config(policy, replicas), stop_below=None)
    return simulate_workload(setup.perf_for(policy), workload, config)[2]


def _evaluate(
    setup: Setup, policy: Policy, replicas: int, runs: list[dict[str, Any]], rate: float
) -> float:
    """Attainment at one rate; the run is printed (by a worker too: progress as it happens)
    and appended to `runs`. A run stopped early shows the most it could have attained
    ("<" before it in the printout, `stopped_early` in the JSON) and has no report."""
    run_report, result, run_backlog = setup.run(policy, replicas, rate)
    value = attainment(run_report, result)
    shown = f"{value:.3f}" if run_report is not None else f"<{value:.3f}"
    tqdm.write(
        f"{setup.scenario.value:<11} {policy.value:<15} {replicas:>7}{rate:>10.3f}"
        f"{shown:>8}{result.wall_s:>8.1f}"
    )
    sys.stdout.flush()
    runs.append(
        {
            "scenario": setup.scenario.value,
            "policy": policy.value,
            "replicas": replicas,
            "rate_per_replica": rate,
            "attainment": value,
            "stopped_early": run_report is None,
            "paper_attainment": None if run_report is None else run_report.overall.paper_attainment,
            "arrival_window_s": run_backlog.arrival_window_s,
            "backlog_s": run_backlog.backlog_s,
            "sustained": run_backlog.sustained(value >= DEFAULT_TARGET),
            "steps": result.steps,
            "simulated_s": result.end_s,
            "wall_s": result.wall_s,
            "busy_s": result.busy_s,
            "utilization": result.busy_s / (replicas * result.end_s) if result.end_s else 0.0,
            "busy_ms_per_request": None
            if run_report is None
            else 1e3 * result.busy_s / len(result.outcomes),
            "preemptions": result.preemptions,
            "preempted_tokens": result.preempted_tokens,
            "demoted": result.demoted,
            "promoted": result.promoted,
            "prefix_hit_rate": result.prefix_hits / result.prefix_queries
            if result.prefix_queries
            else None,
            "prefix_credit_missed": result.credit_missed_tokens / result.credited_tokens
            if result.credited_tokens
            else None,
            "drafts_per_decode": result.verified_drafts / result.decode_steps
            if result.decode_steps
            else 0.0,
            "draft_acceptance": result.accepted_drafts / result.verified_drafts
            if result.verified_drafts
            else None,
            "report": None if run_report is None else run_report.to_dict(),
        }
    )
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
