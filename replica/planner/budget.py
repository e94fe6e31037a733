"""The budget function: how many prefill tokens a batch period leaves once decoders are served.

Autoregressive (Algorithm 2): the period is the tightest TPOT among SLO requests and the batch
is the largest whose predicted time fits it; a decoder of a looser tier needs a token only
every tpot / period batches, so it costs period / tpot tokens per batch on average.

Speculative (Appendix D): with per-token acceptance a, a verify of s drafts yields
E(s) = (1 - a^(s+1)) / (1 - a) tokens on average, so the tightest tier may stretch the period to
tpot * E(s). For each s of the tightest tier, every looser tier speculates s too (it would keep
up with the period on less), the draft model's cost enters the batch time, and the choice with
the most prefill tokens per second wins. s = 0 is always a candidate, so speculation is chosen
only when it pays.

Why looser tiers get the tightest tier's s rather than the least that keeps up with them:
autoregressive batches of the tightest TPOT give every decoder ahead of its line a token per
batch from leftover tokens, so a looser tier left at s_t = 0 would decode one token per
stretched period instead, slower than without speculation. Its requests then hold their KV
longer and, where KV binds admission, fewer are admitted: in simulation (mixed, 2 replicas,
3.5 req/s each) the 100 ms tiers went from 38 to 54 ms per token, residence +44%, and
attainment from 0.96 (no speculation) to 0.86. Budgeting them (s + 1) tokens per batch makes
a speculating option pay for serving everyone at least at the autoregressive pace.

The capacity is computed for a worst-case batch: every request due in it counted, each reading
its KV up to its reservation and every query token attending to the longest reservation, so any
batch the planner forms within `batch_tokens` tokens finishes within the period (attention taken
as ragged, as the perf model's inverse does). In an autoregressive budget a decoder of a looser
tier is due in tpot_tightest / tpot of the batches, so it counts as that fraction of a request
and of its KV, as it counts period / tpot tokens; a speculating budget serves every decoder in
every batch and counts them whole. Counting every decoder whole in every batch made the period
of a batch of ~20 requests on the CPU demo profile (0.7 ms per request) hold no prefill at all,
so admission declined what the baselines served on time (loadgen/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from replica.batch import RequestOutcome
from replica.compiled import reduce_frozen
from replica.perf_model import BatchTimeModel
from replica.planner.config import SpecConfig
from replica.planner.deadlines import chain_deadline


def expected_tokens(acceptance: float, spec_len: int) -> float:
    """Tokens one verify of `spec_len` drafts yields on average (the bonus token included)."""
    if acceptance >= 1.0:
        return float(spec_len + 1)
    return (1.0 - acceptance ** (spec_len + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class TierLoad:
    """Decoders sharing one TPOT."""

    tpot_s: float
    num_decoders: int


@dataclass(frozen=True)
class WorstBatch:
    """The batch a budget's capacity is computed for, and the least period that batch needs."""

    num_requests: int
    max_context: int
    """Keys per query token."""
    kv_tokens: int
    """KV entries read."""
    min_period_s: float = 0.0
    """One batch of its running requests: a shorter period serves them no token."""


@dataclass(frozen=True)
class BatchBudget:
    """One choice of period, batch size and per-tier speculation, valid until the next replan."""

    period_s: float
    batch_tokens: int
    """Query tokens one batch may hold and still finish within the period."""
    num_requests: int
    """Requests per batch the capacity was computed for."""
    max_context: int
    """Keys per query token the capacity was computed for."""
    kv_tokens: int
    """KV entries read per batch the capacity was computed for."""
    acceptance: float
    max_spec_tokens: int
    draft_steps: int
    draft_batch: int
    overruns: bool = False
    """Even one token overruns the period in the worst case: `batch_tokens` is floored at 1
    so that running requests progress, but no new request can be guaranteed on it."""
    min_spec_len: int = 0
    """Speculation every decoder gets at least: the tightest tier's length when the budget
    drafts, so looser tiers do not slow down (see the module notes)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)

    def spec_len(self, tpot_s: float) -> int:
        """Shortest speculation that lets a decoder of this TPOT keep up with the period, and
        at least `min_spec_len`."""
        need = self.period_s / tpot_s
        if need <= 1.0 + 1e-9:
            return self.min_spec_len
        for s in range(max(1, self.min_spec_len), self.max_spec_tokens + 1):
            if expected_tokens(self.acceptance, s) >= need - 1e-9:
                return s
        return self.max_spec_tokens

    def chain_deadline(self, deadlines: tuple[float, ...], tpot_s: float, prompt: bool) -> float:
        """When the first of a request's crowded `deadlines` (a stage starts early) must be
        out for the rest to be on time, served one verify a batch: a token a period, or
        E(s) a period on average where this budget speculates for `tpot_s`. After a
        prompt's first token (`prompt`) the first verify is a whole period away. Paced by
        the period alone, a speculating budget's long period would pull the first token of
        a long chain ever further forward."""
        pace = self.period_s / expected_tokens(self.acceptance, self.spec_len(tpot_s))
        return chain_deadline(deadlines, self.period_s if prompt else pace, pace)

    def prompt_deadline(self, deadline: float, tpot_s: float) -> float:
        """When a prompt whose first token is due at `deadline` must be done: a period
        minus one TPOT sooner, so that its first verify, a period later, is on time too."""
        return deadline - max(0.0, self.period_s - tpot_s)

    def prompt_due(self, deadline: float, tpot_s: float, chain: tuple[float, ...]) -> float:
        """When a prompt must be done for its first decode batch to be on time, and, before a
        stage that starts early (`chain`: the crowded deadlines), the tokens up to it too."""
        due = self.prompt_deadline(deadline, tpot_s)
        return min(due, self.chain_deadline(chain, tpot_s, True)) if chain else due

    def cost_per_batch(self, tpot_s: float) -> float:
        """Query tokens a decoder of this TPOT costs per batch on average."""
        s = self.spec_len(tpot_s)
        return float(s + 1) if s > 0 else self.period_s / tpot_s

    def prefill_tokens(self, loads: Sequence[TierLoad]) -> float:
        """Prefill tokens per batch left after the decoders of `loads`."""
        decode = sum(load.num_decoders * self.cost_per_batch(load.tpot_s) for load in loads)
        return self.batch_tokens - decode

    def tokens_within(self, perf: BatchTimeModel, seconds: float) -> int:
        """Batch capacity under the same worst-case assumptions for a shorter time limit."""
        return capacity(
            perf,
            seconds,
            self.num_requests,
            self.max_context,
            self.kv_tokens,
            self.draft_steps,
            self.draft_batch,
        )

    def seconds_for(self, perf: BatchTimeModel, tokens: int) -> float:
        """The worst-case batch's time with `tokens` query tokens (`tokens_within` inverted)."""
        return perf.predict_aggregate(
            num_tokens=tokens,
            num_requests=self.num_requests,
            attn_tokens=tokens * self.max_context,
            kv_tokens=self.kv_tokens + tokens,
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
        )

    def cut_tokens(self, perf: BatchTimeModel) -> int:
        """What one more batch boundary costs at most: the tokens lost when it leaves a part
        of a period just too short for a batch of one token, and the rest holds what it
        holds (a batch's time is a max of affine terms, so no other split loses more), plus
        two for the whole tokens the capacities round down to around the cut. (Halves would
        lose one fixed time; a perf model whose short batches cost a floor, reading the
        weights, loses more to an uneven cut, and the plans must hold.)"""
        rest = self.period_s - self.seconds_for(perf, 1)
        return max(0, self.batch_tokens - self.tokens_within(perf, rest) + 2)


def capacity(
    perf: BatchTimeModel,
    seconds: float,
    num_requests: int,
    max_context: int,
    kv_tokens: int,
    draft_steps: int = 0,
    draft_batch: int = 0,
) -> int:
    """Most query tokens a batch of `num_requests` requests can hold within `seconds` when
    every token attends to `max_context` keys and the requests read `kv_tokens` cached keys."""
    return perf.max_new_tokens_within(
        seconds,
        num_requests=num_requests,
        base_tokens=0,
        base_attn_tokens=0,
        context_per_new_token=max_context,
        draft_steps=draft_steps,
        draft_batch=draft_batch,
        base_kv_tokens=kv_tokens,
    )


def plan_budgets(
    perf: BatchTimeModel,
    loads: Sequence[TierLoad],
    *,
    num_requests: int,
    max_context: int,
    kv_tokens: int,
    idle_period_s: float,
    spec: SpecConfig | None = None,
    acceptance: float = 0.0,
    min_period_s: float = 0.0,
    urgent_periods_s: Sequence[float] = (),
    urgent_batch: WorstBatch | None = None,
    speculating_batch: WorstBatch | None = None,
) -> tuple[BatchBudget, ...]:
    """The period and speculation lengths with the most prefill tokens per second, followed by
    the autoregressive budget when the best one speculates (else by the best speculating
    one, if any), and by a shorter autoregressive period for each of `urgent_periods_s` below
    the tightest TPOT.

    A longer period makes a speculating request's prefill end earlier (its first verify must
    land within one TPOT of its first token), which throughput alone does not see; the caller
    keeps whichever admits more. The period never drops below `min_period_s` (the caller's
    time for one batch of the running decoders: a TPOT tighter than that cannot be met, and
    smaller batches would only fall further behind). `loads` lists the decoders the plan must
    serve per TPOT (running and candidates); tiers without decoders still bound the period.
    Without loads the period is `idle_period_s` (at least one token per batch, so best-effort
    work always progresses). `urgent_periods_s` are periods the most urgent requests need: a
    request with tokens due closer together than one per period is only on time with batches
    that short (fewer tokens per second; the caller keeps one only when it keeps more on time).
    A prompt merely due inside a period needs no such option (the admission DP counts a batch
    cut at its deadline), except beside long decodes: the capacity of an urgent option is
    computed for `urgent_batch` (default: the main batch, with `min_period_s`), which may
    leave out decoders so far ahead of their line that no batch within the plan's horizon must
    serve them (a batch takes them only in time it has left), so a tight-TTFT prompt fits a
    short batch whose worst case would otherwise read every decoder's KV.
    `speculating_batch` (default: the main batch) is the batch speculating options are sized
    for: they serve every decoder in every batch, so it must count them all, while the main
    batch may count a decoder of a looser tier as the fraction of batches it is due in
    (`SlosScheduler._worst_batch`)."""
    every = (
        (speculating_batch.num_requests, max_context, speculating_batch.kv_tokens)
        if speculating_batch is not None
        else (num_requests, max_context, kv_tokens)
    )
    max_spec = spec.max_spec_tokens if spec is not None and acceptance > 0 else 0
    decoders = sum(load.num_decoders for load in loads)
    if max_spec > 0 and every[0] < decoders:
        raise ValueError(
            f"num_requests={every[0]} is below the {decoders} decoders the budget must serve"
        )
    if not loads:
        idle = BatchBudget(
            period_s=idle_period_s,
            batch_tokens=max(
                1, capacity(perf, idle_period_s, num_requests, max_context, kv_tokens)
            ),
            num_requests=num_requests,
            max_context=max_context,
            kv_tokens=kv_tokens,
            acceptance=acceptance,
            max_spec_tokens=max_spec,
            draft_steps=0,
            draft_batch=0,
        )
        return (idle,)
    tightest = max(min(load.tpot_s for load in loads), min_period_s)
    options = [
        option
        for s0 in range(max_spec + 1)
        if (
            option := _option(
                perf,
                loads,
                tightest,
                s0,
                every if s0 > 0 else (num_requests, max_context, kv_tokens),
                acceptance,
                max_spec,
            )
        )
        is not None
    ]
    # max() keeps the first of equal options, i.e. the shorter speculation.
    best = max(options, key=lambda o: o[0])[1]
    speculating = [o for o in options if o[1].draft_steps > 0]
    if best.draft_steps > 0:
        chosen: tuple[BatchBudget, ...] = (best, options[0][1])
    elif speculating:
        chosen = (best, max(speculating, key=lambda o: o[0])[1])
    else:
        chosen = (best,)
    near = urgent_batch or WorstBatch(num_requests, max_context, kv_tokens, min_period_s)
    shortest = max(near.min_period_s, 1e-9)
    shape = (near.num_requests, near.max_context, near.kv_tokens)
    for period in sorted({p for p in urgent_periods_s if shortest <= p < tightest}):
        urgent = _option(perf, loads, period, 0, shape, acceptance, max_spec)
        assert urgent is not None  # s0 = 0 is always an option
        if not urgent[1].overruns:  # batches that short hold no token: they serve no one
            chosen = (*chosen, urgent[1])
    return chosen


def _option(
    perf: BatchTimeModel,
    loads: Sequence[TierLoad],
    tightest: float,
    s0: int,
    shape: tuple[int, int, int],
    acceptance: float,
    max_spec: int,
) -> tuple[float, BatchBudget] | None:
    """(prefill tokens per second, budget) when the tightest tier speculates s0 tokens; None
    when speculating makes some tier unable to keep up with the period (s0 = 0 is always an
    option, even in overload)."""
    num_requests, max_context, kv_tokens = shape
    period = tightest * expected_tokens(acceptance, s0)
    probe = BatchBudget(period, 0, *shape, acceptance, max_spec, 0, 0, min_spec_len=s0)
    lens = [probe.spec_len(load.tpot_s) for load in loads]
    if s0 > 0 and any(
        expected_tokens(acceptance, s) < period / load.tpot_s - 1e-9
        for load, s in zip(loads, lens, strict=True)
    ):
        return None
    # An urgent option's batch holds only the decoders due soon (`WorstBatch`): at most that
    # many of the drafting tiers' decoders ride, and draft, in it.
    drafting = sum(load.num_decoders for load, s in zip(loads, lens, strict=True) if s > 0)
    draft_batch = min(drafting, num_requests)
    draft_steps = max(lens) if draft_batch > 0 else 0
    fits = capacity(perf, period, *shape, draft_steps, draft_batch)
    budget = BatchBudget(
        period_s=period,
        # At least one token, as in the idle budget: a worst case that overruns the period
        # (drafting costs more than the running decoders' batch the period was floored at)
        # must still let the running requests progress.
        batch_tokens=max(1, fits),
        num_requests=num_requests,
        max_context=max_context,
        kv_tokens=kv_tokens,
        acceptance=acceptance,
        max_spec_tokens=max_spec,
        draft_steps=draft_steps,
        draft_batch=draft_batch,
        overruns=fits < 1,
        min_spec_len=s0,
    )
    return budget.prefill_tokens(loads) / period, budget


def judged_drafts(drafted: int, accepted: int) -> int:
    """Drafts a verify judged: each is accepted with the per-token rate until the first
    rejection; the ones after it are dropped unjudged. Counting them too would estimate
    E(accepted) / k rather than the rate (0.33 at k = 4 for a rate of 0.6), and the planner,
    whose E(s) takes the per-token rate, would talk itself out of speculating."""
    return accepted + (accepted < drafted)


def outcome_judged(outcome: RequestOutcome) -> int:
    """The drafts a verify judged: as the engine counted them (a tree's), else a chain's."""
    if outcome.num_judged_drafts is not None:
        return outcome.num_judged_drafts
    return judged_drafts(outcome.num_draft_tokens, outcome.num_accepted_tokens)


class AcceptanceEstimate:
    """Per-token acceptance of the draft model, an EMA over observed verifies."""

    def __init__(self, spec: SpecConfig) -> None:
        self.spec = spec
        self.value = min(spec.initial_acceptance, spec.max_acceptance)

    def observe(self, judged: int, accepted: int) -> None:
        """Fold in one batch: `accepted` of the `judged` drafts (see `judged_drafts`)."""
        if judged <= 0:
            return
        if not 0 <= accepted <= judged:
            raise ValueError(f"accepted={accepted} must be within [0, judged={judged}]")
        rate = accepted / judged
        blended = (1.0 - self.spec.ema_weight) * self.value + self.spec.ema_weight * rate
        self.value = min(self.spec.max_acceptance, blended)
