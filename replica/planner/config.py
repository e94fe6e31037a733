"""Knobs of the SLOs-Serve planner, validated once so a bad value fails at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def check_int(name: str, value: int, low: int = 1) -> None:
    """An integer >= low, named when it is not; shared by every planner's config."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def check_fraction(name: str, value: float, *, low: float, high: float) -> None:
    """A finite number in [low, high], named when it is not."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")


def check_positive(name: str, value: object) -> None:
    """A finite number > 0, named when it is not."""
    _check_sign(name, value, zero=False)


def check_non_negative(name: str, value: object) -> None:
    """A finite number >= 0, named when it is not."""
    _check_sign(name, value, zero=True)


def _check_sign(name: str, value: object, *, zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be finite and {'>=' if zero else '>'} 0, got {value!r}")


def check_text(name: str, value: object, *, optional: bool = False) -> None:
    """A non-empty string (or None, when `optional`), named when it is not."""
    if optional and value is None:
        return
    if not isinstance(value, str) or not value:
        kind = "a non-empty string or null" if optional else "a non-empty string"
        raise ValueError(f"{name} must be {kind}, got {value!r}")


def _check_optional(name: str, value: object, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"{name} must be {article} {kind.__name__} or None, got {value!r}")


@dataclass(frozen=True)
class SpecConfig:
    """SLO-adaptive speculation (Appendix D): per-tier lengths chosen from the acceptance rate."""

    max_spec_tokens: int = 4
    """Longest speculation the planner may choose for a tier (0 disables speculation)."""
    initial_acceptance: float = 0.6
    """Per-token acceptance assumed before any verify has been observed."""
    ema_weight: float = 0.1
    """Weight of each batch's observed acceptance in the running estimate."""
    max_acceptance: float = 0.95
    """Cap on the estimate: plans never assume near-certain acceptance."""
    stretch_kv_fraction: float = 0.5
    """While a prompt waits to be computed (an admitted request's, a new SLO request's or a
    best-effort one's), speculating budgets are offered only if admitted requests reserve at
    least this fraction of the KV cache; with no prompt waiting they always are (so acceptance
    keeps being observed).

    Why: a speculating budget stretches the period to tpot x E(s), and a prompt arriving or
    waiting then sees longer batches in flight, prefill deadlines pulled in by period - tpot
    and whole-batch granularity of the longer period, so tight TTFTs are declined. What it buys
    is decode speed (decoders ahead of their line ride in leftover tokens, E(s) tokens a ride),
    i.e. KV released sooner, which admits more only while KV is what binds. In simulation
    (A100 OPT-7B, acceptance 0.6) ToolLLM, TTFT-bound with KV 18% reserved, lost ~10% capacity
    to speculation; chatbot and mixed, KV-bound (55-80% reserved), gain from it. 1.0 (with
    prompts waiting, never stretch) and 0.0 (always, as before) are the two ends; 0.3-0.5 did
    equally well there, 0.7 and above start to cost chatbot and mixed."""

    def __post_init__(self) -> None:
        check_int("max_spec_tokens", self.max_spec_tokens, low=0)
        check_fraction("initial_acceptance", self.initial_acceptance, low=0.0, high=1.0)
        check_fraction("ema_weight", self.ema_weight, low=0.0, high=1.0)
        check_fraction("max_acceptance", self.max_acceptance, low=0.0, high=0.999)
        check_fraction("stretch_kv_fraction", self.stretch_kv_fraction, low=0.0, high=1.0)


@dataclass(frozen=True)
class OutputEstimateConfig:
    """KV reservations from observed output lengths (replica.planner.output_estimate)."""

    quantile: float = 0.8
    """Quantile of finished output lengths a new request reserves for (lower: more admitted
    at once, more reservations to extend or demote)."""
    min_samples: int = 20
    """Finished requests (per max_tokens) before the quantile replaces `prior_tokens`."""
    prior_tokens: int = 512
    """Stands in for the quantile until then (capped at max_tokens). Every reservation step is
    also capped by `chunk_tokens` / `extension_tokens`, so the prior binds only when set
    below them."""
    window: int = 256
    """Most recent finished requests the quantile is taken over."""
    chunk_tokens: int = 128
    """Most output tokens a new request's first reservation covers: an output holds memory as
    it grows instead of its quantile from the start. Where KV memory binds, small chunks admit
    more (simulated, 1 replica, attainment with 512 -> 128: chatbot at 3.75 req/s 0.81 -> 0.94,
    mixed at 4 req/s 0.79 -> 0.91; loadgen/RESULTS.md); 64 did as well, 256 and 512 worse."""
    extension_tokens: int = 32
    """Most output tokens each later extension adds. Why smaller than the first: a running
    request's headroom is memory no one uses until it grows into it, while the first chunk is
    what every admission leaves free for the growth of the requests already in. In simulation
    (A100 OPT-7B, 1 replica, four trace windows) 32 after a first 128 raised slos's capacity in
    9 of 24 scenario-window pairs and lowered it in 1 with no admitted request missing outside
    reasoning; 32 for the first chunk too raised chatbot and mixed as well but broke 1-3
    guarantees per 900 chatbot requests (loadgen/RESULTS.md)."""

    def __post_init__(self) -> None:
        check_fraction("quantile", self.quantile, low=0.0, high=1.0)
        check_int("min_samples", self.min_samples)
        check_int("prior_tokens", self.prior_tokens)
        check_int("window", self.window)
        check_int("chunk_tokens", self.chunk_tokens)
        check_int("extension_tokens", self.extension_tokens)


@dataclass(frozen=True)
class InvocationConfig:
    """When the planner re-solves admission and the batch budget (Algorithm 1's triggers)."""

    interval_s: float = 0.05
    """Replan at least this often, waiting requests or not: the budget follows the decoders as
    they grow and finish, and declined requests are offered again (`SlosScheduler._promotable`).
    Replanning only while a request waits lost capacity in simulation (loadgen/RESULTS.md)."""
    new_requests: int = 1
    """Replan once this many requests await admission."""
    finished_requests: int = 8
    """Replan after this many requests finished (frees memory and decode budget)."""
    drift_fraction: float = 0.25
    """Replan when a batch's measured time exceeds its prediction by this fraction."""
    behind_tpot_factor: float = 0.5
    """A request that fell behind its token deadlines is planned with TPOT times this factor."""

    def __post_init__(self) -> None:
        check_positive("interval_s", self.interval_s)
        check_int("new_requests", self.new_requests)
        check_int("finished_requests", self.finished_requests)
        check_fraction("drift_fraction", self.drift_fraction, low=0.0, high=10.0)
        check_fraction("behind_tpot_factor", self.behind_tpot_factor, low=0.05, high=1.0)


@dataclass(frozen=True)
class LapsConfig:
    """LAPS-SD's order inside the best-effort tier (replica.planner.laps). The paper gives no
    values for K, M, S_1, gamma or delta; these are chosen for steps of tens of milliseconds
    and outputs of hundreds of tokens."""

    num_levels: int = 4
    """K: the queues by attained service."""
    first_level_s: float = 0.5
    """S_1: attained service (seconds of steps) that ends the first level."""
    growth: float = 4.0
    """M: each level ends at M times the service of the one before."""
    window: int = 4
    """gamma: served steps over which the acceptance rate must be stable."""
    stable_spread: float = 0.1
    """delta: the largest max - min of the cumulative acceptance rate over the window for a
    request to count as predictable ("perceptible")."""
    aging_s: float = 10.0
    """Waiting this long since its last step lifts a request one level, so no request
    starves behind a stream of newer ones."""

    def __post_init__(self) -> None:
        check_int("laps.num_levels", self.num_levels)
        check_int("laps.window", self.window)
        check_positive("laps.first_level_s", self.first_level_s)
        check_positive("laps.aging_s", self.aging_s)
        check_fraction("laps.stable_spread", self.stable_spread, low=1e-9, high=1.0)
        check_fraction("laps.growth", self.growth, low=1.0 + 1e-9, high=1e6)
        top = math.log10(self.first_level_s) + (self.num_levels - 1) * math.log10(self.growth)
        if top > 300:
            raise ValueError(
                f"laps.num_levels={self.num_levels} with laps.growth={self.growth!r} puts the "
                "last level beyond 1e300 s of service"
            )


@dataclass(frozen=True)
class GoodspeedConfig:
    """GOODSPEED's re-split of a step's drafts (replica.planner.goodspeed)."""

    acceptance_weight: float = 0.2
    """eta: weight of a verify's acceptance rate in the request's EMA (the paper leaves it
    open)."""
    goodput_weight: float = 0.5
    """beta: weight of a step's tokens in the request's EMA goodput (the paper's 0.5)."""
    eps: float = 0.01
    """Acceptance estimates stay within [eps, 1 - eps]."""

    def __post_init__(self) -> None:
        check_fraction("goodspeed.acceptance_weight", self.acceptance_weight, low=0.0, high=1.0)
        check_fraction("goodspeed.goodput_weight", self.goodput_weight, low=1e-9, high=1.0)
        check_fraction("goodspeed.eps", self.eps, low=1e-9, high=0.5)


@dataclass(frozen=True)
class PlannerConfig:
    """The DP's resolution and the batch shapes it may plan."""

    memory_units: int = 16
    """Free KV memory is split into this many units for the DP (requests round up)."""
    max_dp_candidates: int = 16
    """Larger bursts are decided in deadline-ordered groups of this size (bounds DP time)."""
    idle_period_s: float = 0.05
    """Batch period when no SLO request bounds it (only best-effort work)."""
    max_best_effort_requests: int = 8
    """Most best-effort requests per batch (they fill the time SLO work leaves in it)."""
    best_effort_stretch: float = 0.1
    """Best-effort work may lengthen a batch of SLO work by at most this fraction of its time
    (the first best-effort request always gets a token while the batch stays within its
    period, so the tier progresses). Longer batches slow every admitted decoder, which then
    holds its KV longer: where KV binds admission, best-effort prefills filling each batch to
    its period cut what the DP could admit (simulated, A100 OPT-7B, 1 replica, chatbot at 4
    req/s: attainment 0.80 filling to the period, 0.94 with 0.1; loadgen/RESULTS.md)."""
    spec: SpecConfig | None = None
    """Speculation settings; None plans autoregressive decoding only."""
    output_estimate: OutputEstimateConfig | None = None
    """Reserve KV for an estimated output length; None reserves prompt + max_tokens."""
    invocation: InvocationConfig = field(default_factory=InvocationConfig)
    goodspeed: GoodspeedConfig | None = None
    """Re-split each step's drafts across its requests by GOODSPEED (needs `spec`); None: each
    speculates its tier's length."""
    laps: LapsConfig | None = None
    """Order the best-effort requests that cannot meet their next deadline (or have none) by
    LAPS-SD (replica.planner.laps); None: oldest first."""

    def __post_init__(self) -> None:
        check_int("memory_units", self.memory_units)
        check_int("max_dp_candidates", self.max_dp_candidates)
        check_positive("idle_period_s", self.idle_period_s)
        check_int("max_best_effort_requests", self.max_best_effort_requests, low=0)
        check_fraction("best_effort_stretch", self.best_effort_stretch, low=0.0, high=10.0)
        _check_optional("spec", self.spec, SpecConfig)
        _check_optional("output_estimate", self.output_estimate, OutputEstimateConfig)
        _check_optional("goodspeed", self.goodspeed, GoodspeedConfig)
        _check_optional("laps", self.laps, LapsConfig)
        if self.goodspeed is not None and self.spec is None:
            raise ValueError("goodspeed re-splits drafts: it needs spec (speculation)")
        if not isinstance(self.invocation, InvocationConfig):
            raise ValueError(f"invocation must be an InvocationConfig, got {self.invocation!r}")
