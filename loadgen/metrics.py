"""SLO attainment, goodput and latency percentiles from per-request records.

Two ways to judge a request, both reported:

- Deadline semantics (ours, what the planner guarantees): output token j must reach the client
  by arrival + SLO.deadline_s(j), i.e. arrival + TTFT + j x TPOT (piecewise with stages). Early
  tokens bank slack; a later stall is fine as long as the line is never crossed.
- The paper's form (SLOs-Serve section 6): TTFT slowdown over the zero-load TTFT within the
  target (equivalently TTFT <= SLO.ttft_ms), and the max TPOT over windows of 10 tokens within
  the TPOT target, because speculative decoding delivers tokens in bursts. Windows are
  consecutive spans of 10 gaps from the first token, the last one ending at the last token (so
  overlapping the one before: a short last window would judge a single late gap alone); a
  window is held to the TPOT that governs its last token. An output of fewer than 10 gaps is
  one window.

In both, a request attains only if it delivered all output_len tokens; rejected requests never
attain. Best-effort requests are judged like the others: a deferred request that still met its
SLO counts. Goodput counts attained requests (and their tokens) per second of the run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from loadgen.records import RequestRecord, Verdict
from replica.request import SLO

TPOT_WINDOW = 10
EPS_S = 1e-9
"""Slack for float round-off when a token lands exactly on its deadline."""


def ttft_s(record: RequestRecord) -> float | None:
    first = record.first_token_s
    return None if first is None else first - record.arrival_s


def e2e_s(record: RequestRecord) -> float | None:
    """Arrival to the last token, for a request that delivered all of its output."""
    if not record.complete:
        return None
    return record.token_times_s[-1] - record.arrival_s


def ttft_slowdown(record: RequestRecord) -> float | None:
    ttft = ttft_s(record)
    return None if ttft is None else ttft / record.zero_load_ttft_s


def mean_tpot_s(record: RequestRecord) -> float | None:
    """Average gap between tokens after the first, over the tokens the request was meant to get."""
    n = min(record.delivered, record.output_len)
    if n < 2:
        return None
    times = record.token_times_s
    return (times[n - 1] - times[0]) / (n - 1)


def windowed_tpots(
    record: RequestRecord, window: int = TPOT_WINDOW
) -> tuple[np.ndarray, np.ndarray]:
    """(last token index, mean TPOT) of each window of `window` gaps after the first token: the
    last window is the last `window` gaps (overlapping the one before), so each holds `window`
    gaps when the output has that many."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    times = np.asarray(record.token_times_s[: record.output_len])
    gaps = max(len(times) - 1, 0)
    starts = np.minimum(np.arange(0, gaps, window), max(gaps - window, 0))
    ends = np.minimum(starts + window, gaps)
    return ends, (times[ends] - times[starts]) / (ends - starts)


def max_windowed_tpot_s(record: RequestRecord, window: int = TPOT_WINDOW) -> float | None:
    _, tpots = windowed_tpots(record, window)
    return float(tpots.max()) if len(tpots) else None


def _stage_starts(slo: SLO) -> list[int]:
    """Index of each stage's first output token ([0] without stages)."""
    return [slo.stage_start(i) for i in range(max(1, len(slo.stages)))]


def deadlines_s(slo: SLO, n: int) -> np.ndarray:
    """SLO.deadline_s(j) for j < n, vectorized: the line is straight within a stage, so only
    each stage's first token asks the SLO (long reasoning outputs have thousands of tokens)."""
    bounds = [s for s in _stage_starts(slo) if s < n] + [n]
    out = np.empty(n)
    for begin, end in itertools.pairwise(bounds):
        out[begin:end] = slo.deadline_s(begin) + np.arange(end - begin) * slo.tpot_at(begin)
    return out


def tpot_targets_s(slo: SLO, tokens: np.ndarray) -> np.ndarray:
    """SLO.tpot_at(j) for each token index j, vectorized the same way."""
    starts = _stage_starts(slo)
    per_stage = np.array([slo.tpot_at(s) for s in starts])
    return per_stage[np.searchsorted(starts, tokens, side="right") - 1]


def attained_deadline(record: RequestRecord) -> bool:
    """Every token j up to output_len by arrival + deadline_s(j)."""
    if record.verdict is Verdict.REJECTED or not record.complete:
        return False
    n = record.output_len
    late = np.asarray(record.token_times_s[:n]) - record.arrival_s
    return bool(np.all(late <= deadlines_s(record.slo, n) + EPS_S))


def attained_paper(record: RequestRecord, window: int = TPOT_WINDOW) -> bool:
    """TTFT within target, and every window's TPOT within the TPOT of its last token."""
    if record.verdict is Verdict.REJECTED or not record.complete:
        return False
    ttft = ttft_s(record)
    if ttft is None or ttft > record.slo.ttft_ms / 1e3 + EPS_S:
        return False
    ends, tpots = windowed_tpots(record, window)
    return bool(np.all(tpots <= tpot_targets_s(record.slo, ends) + EPS_S))


@dataclass(frozen=True)
class Percentiles:
    p50: float | None
    p99: float | None
    count: int
    mean: float | None = None


def percentiles(values: Iterable[float | None]) -> Percentiles:
    """p50 and p99 (linear interpolation) and the mean of the values that exist."""
    data = [v for v in values if v is not None]
    if not data:
        return Percentiles(None, None, 0)
    array = np.asarray(data)
    p50, p99 = np.percentile(array, [50, 99])
    return Percentiles(float(p50), float(p99), len(data), float(array.mean()))


@dataclass(frozen=True)
class GroupReport:
    """Attainment and latency of one group of requests (all, one SLO class, one scenario)."""

    requests: int
    admitted: int
    best_effort: int
    rejected: int
    unknown: int
    """Verdict never reported (the client closed the stream at output_len, or it failed)."""
    completed: int
    attained_deadline: int
    attained_paper: int
    ttft_s: Percentiles
    ttft_slowdown: Percentiles
    mean_tpot_s: Percentiles
    max_windowed_tpot_s: Percentiles
    e2e_s: Percentiles
    """Arrival to last token of the completed requests (mean latency: what the best-effort
    tier's order, FCFS or LAPS-SD, is judged by)."""

    @property
    def attainment(self) -> float:
        """Share of requests on time under deadline semantics."""
        return self.attained_deadline / self.requests

    @property
    def paper_attainment(self) -> float:
        return self.attained_paper / self.requests

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "attainment": self.attainment,
            "paper_attainment": self.paper_attainment,
        }


@dataclass(frozen=True)
class Judgment:
    """One record's verdicts and latencies, computed once and shared by every grouping."""

    record: RequestRecord
    attained_deadline: bool
    attained_paper: bool
    ttft_s: float | None
    ttft_slowdown: float | None
    mean_tpot_s: float | None
    max_windowed_tpot_s: float | None
    e2e_s: float | None


def judge(record: RequestRecord) -> Judgment:
    return Judgment(
        record=record,
        attained_deadline=attained_deadline(record),
        attained_paper=attained_paper(record),
        ttft_s=ttft_s(record),
        ttft_slowdown=ttft_slowdown(record),
        mean_tpot_s=mean_tpot_s(record),
        max_windowed_tpot_s=max_windowed_tpot_s(record),
        e2e_s=e2e_s(record),
    )


def group_report(judged: Sequence[Judgment]) -> GroupReport:
    if not judged:
        raise ValueError("cannot report on zero records")
    verdicts = [j.record.verdict for j in judged]
    return GroupReport(
        requests=len(judged),
        admitted=verdicts.count(Verdict.ADMITTED),
        best_effort=verdicts.count(Verdict.BEST_EFFORT),
        rejected=verdicts.count(Verdict.REJECTED),
        unknown=verdicts.count(Verdict.UNKNOWN),
        completed=sum(j.record.complete for j in judged),
        attained_deadline=sum(j.attained_deadline for j in judged),
        attained_paper=sum(j.attained_paper for j in judged),
        ttft_s=percentiles(j.ttft_s for j in judged),
        ttft_slowdown=percentiles(j.ttft_slowdown for j in judged),
        mean_tpot_s=percentiles(j.mean_tpot_s for j in judged),
        max_windowed_tpot_s=percentiles(j.max_windowed_tpot_s for j in judged),
        e2e_s=percentiles(j.e2e_s for j in judged),
    )


def _grouped(
    judged: Sequence[Judgment], key: Callable[[RequestRecord], str]
) -> dict[str, GroupReport]:
    groups: dict[str, list[Judgment]] = {}
    for j in judged:
        groups.setdefault(key(j.record), []).append(j)
    return {k: group_report(v) for k, v in sorted(groups.items())}


@dataclass(frozen=True)
class RunReport:
    """Everything a run is judged by; `to_dict` is the JSON form."""

    duration_s: float
    overall: GroupReport
    by_slo_class: dict[str, GroupReport]
    by_scenario: dict[str, GroupReport]
    by_verdict: dict[str, GroupReport]
    """Admitted, best-effort, rejected: how each tier fared."""
    goodput_rps: float
    """Requests attained (deadline semantics) per second."""
    goodput_tokens_per_s: float
    """Output tokens of attained requests per second."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "goodput_rps": self.goodput_rps,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "overall": self.overall.to_dict(),
            "by_slo_class": {k: v.to_dict() for k, v in self.by_slo_class.items()},
            "by_scenario": {k: v.to_dict() for k, v in self.by_scenario.items()},
            "by_verdict": {k: v.to_dict() for k, v in self.by_verdict.items()},
        }


def run_span_s(records: Sequence[RequestRecord]) -> float:
    """First arrival to the last event (token or arrival)."""
    start = min(r.arrival_s for r in records)
    end = max(max(r.token_times_s, default=r.arrival_s) for r in records)
    return end - start


def report(records: Sequence[RequestRecord], duration_s: float | None = None) -> RunReport:
    """Judge a run. duration_s defaults to run_span_s (goodput's denominator)."""
    if not records:
        raise ValueError("cannot report on zero records")
    duration = run_span_s(records) if duration_s is None else duration_s
    if not duration > 0:
        raise ValueError(f"duration_s must be > 0, got {duration!r}")
    judged = [judge(r) for r in records]
    attained = [j.record for j in judged if j.attained_deadline]
    return RunReport(
        duration_s=duration,
        overall=group_report(judged),
        by_slo_class=_grouped(judged, lambda r: r.slo_class),
        by_scenario=_grouped(judged, lambda r: r.scenario),
        by_verdict=_grouped(judged, lambda r: r.verdict.value),
        goodput_rps=len(attained) / duration,
        goodput_tokens_per_s=sum(r.output_len for r in attained) / duration,
    )
