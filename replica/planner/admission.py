"""DP admission: the most valuable set of new requests whose SLOs can all be guaranteed.

Batches run back to back from `now`, each at most one period long and holding at most
`batch_tokens` query tokens, so batch k ends by now + k * period. A prompt due between two
such ends may also finish in a batch cut short at its deadline (`form_batch` cuts it), which
holds what the worst-case batch fits in the time left; every such cut beyond the first costs
at most the time of a one-token batch (`BatchBudget.cut_tokens`), charged once a prompt needs
it. Without cuts, a deadline inside a period would forfeit the rest of that period, a large
share of a TTFT only a few periods long.
Served earliest deadline first, the work is feasible when at every prefill deadline d (k =
batches that end by d, the last one possibly cut at d) the demand that must be done within
those k batches fits in what they hold:

  - the prompts of every admitted request whose prefill deadline is <= d, and
  - every decode token due before the end of batch k + 1 (it must ride in batch <= k).

Running requests are forced in; their demand is counted exactly. A new request accepted at its
deadline adds its prompt and, from then on, its decode tokens. Those are tracked per TPOT tier
as an affine bound (tokens per batch, plus a per-request offset fixed at acceptance), so the
DP state is (memory units, accepted per tier) -> (value, tokens consumed), which keeps the
highest value and, among equals, the least consumed. Between deadlines only decode demand
grows, at most one batch's worth per batch as long as every decoder fits in one batch, which
the final state must satisfy. Requests are processed in deadline order; requests of a tier the
budget speculates for cost (s + 1) tokens in every batch once their prefill is done, and must
finish their prefill one period minus one TPOT early so that the first verify is on time. A
stage that starts sooner than one TPOT after the previous one adds a token to the count and
pulls the prefill deadline forward so that the tokens up to it fit one verify per batch
(`BatchBudget.chain_deadline`); a running decoder with such tokens ahead is late under a
period too long for them to fit that way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from replica.compiled import reduce_frozen
from replica.perf_model import BatchTimeModel
from replica.planner.budget import BatchBudget

_EPS = 1e-9


@dataclass(frozen=True)
class Candidate:
    """A new request as the DP sees it."""

    request_id: str
    prefill_tokens: int
    """Known tokens to compute before the first token (the prompt)."""
    deadline_s: float
    """Absolute first-token deadline."""
    tpot_s: float
    """Tightest TPOT of its decode stages."""
    decode_tokens: int
    """Tokens after the first it may produce (max_tokens - 1)."""
    blocks: int
    """KV blocks it may hold at its longest (prompt + max_tokens)."""
    value: float = 1.0
    early_tokens: int = 0
    """Tokens that may fall due sooner than even TPOT spacing (`early_stage_starts`)."""
    chain: tuple[float, ...] = ()
    """Deadlines of its first tokens when a stage starts early (`upcoming_deadlines`)."""


@dataclass(frozen=True)
class RunningPrefill:
    """An admitted request still computing its prompt: forced in."""

    prefill_tokens: int
    deadline_s: float
    tpot_s: float
    decode_tokens: int
    early_tokens: int = 0
    chain: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunningDecoders:
    """Admitted requests producing tokens (forced in), as parallel arrays: there are many."""

    next_deadline_s: np.ndarray
    tpot_s: np.ndarray
    remaining_tokens: np.ndarray
    early_tokens: np.ndarray
    """Tokens that may fall due sooner than even TPOT spacing (`early_stage_starts`)."""
    chains: tuple[tuple[float, ...], ...] = ()
    """Per decoder, the deadlines of its next tokens when a stage starts early (else empty):
    one verify per batch, a period too long for them makes it late
    (`BatchBudget.chain_deadline`). Empty: no such decoder."""

    @classmethod
    def of(cls, rows: Sequence[tuple[float, float, int, int]]) -> RunningDecoders:
        """From (next token deadline, TPOT, tokens still to produce, early tokens) rows."""
        columns = list(zip(*rows, strict=True)) if rows else [(), (), (), ()]
        deadline, tpot, remaining, early = (np.asarray(c, dtype=float) for c in columns)
        return cls(deadline, tpot, remaining, early)

    def __len__(self) -> int:
        return len(self.tpot_s)


@dataclass(frozen=True)
class AdmissionProblem:
    now: float
    budget: BatchBudget
    candidates: tuple[Candidate, ...]
    prefills: tuple[RunningPrefill, ...]
    decoders: RunningDecoders
    free_blocks: int
    """KV blocks not reserved by admitted requests."""
    memory_units: int
    perf: BatchTimeModel
    """Prices a batch cut short at a deadline inside a period."""


@dataclass(frozen=True)
class AdmissionResult:
    """The verdict for each candidate; `forced_feasible` is False when even the running
    requests alone no longer fit the plan (then nothing new is admitted)."""

    admitted: tuple[str, ...]
    declined: tuple[str, ...]
    forced_feasible: bool
    budget: BatchBudget
    value: float = 0.0
    """Total value of the admitted candidates."""
    forced_late: int = 0
    """Running requests this budget cannot keep on time (a budget choice should avoid it)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)

    def is_admitted(self, request_id: str) -> bool:
        return request_id in self.admitted

    @property
    def keeps_running(self) -> bool:
        """Every running request stays on time on this budget."""
        return self.forced_feasible and not self.forced_late

    def rank(self) -> tuple[bool, int, float, float]:
        """How budget options compare: running requests kept feasible, then fewer of them
        late, then more admitted value. Among options that keep none feasible (nothing is
        admitted on them), the most tokens a second: in the DP's worst case every one leaves
        a request late, and the real batches, cheaper than that, clear the work soonest."""
        pace = 0.0 if self.forced_feasible else self.budget.batch_tokens / self.budget.period_s
        return self.forced_feasible, -self.forced_late, self.value, pace


def _ar_count(
    grid_end: np.ndarray,
    first: np.ndarray,
    tpot: np.ndarray,
    cap: np.ndarray,
    early: np.ndarray,
) -> np.ndarray:
    """Tokens due before each `grid_end`, spaced `tpot` apart from `first`, plus `early` ones
    once the first is due, at most `cap` (one row per request)."""
    due = np.ceil((grid_end - first) / tpot - _EPS)
    return np.clip(due + early * (due > 0), 0, cap)


@dataclass(frozen=True)
class _Grid:
    """Where event times fall among the plan's batches."""

    batches: np.ndarray
    """Batches that end by each time, the last one cut short at it if that holds a token."""
    whole_tokens: np.ndarray
    """Query tokens the whole periods among them hold."""
    tokens: np.ndarray
    """Query tokens all of them surely hold."""
    next_end: np.ndarray
    """When the batch after them ends."""


def _grid(problem: AdmissionProblem, times: np.ndarray) -> _Grid:
    budget, now = problem.budget, problem.now
    period, batch = budget.period_s, budget.batch_tokens
    whole = np.floor((times - now) / period + _EPS)
    left = times - now - whole * period
    fixed = budget.seconds_for(problem.perf, 0)
    partial = np.array(
        [min(batch, budget.tokens_within(problem.perf, x)) if x > fixed else 0 for x in left],
        dtype=float,
    )
    cut = partial >= 1
    end = np.where(cut, times, now + whole * period)
    return _Grid(
        (whole + cut).astype(np.int64), whole * batch, whole * batch + partial, end + period
    )


def _earliest(problem: AdmissionProblem, tokens: int, deadline: float) -> float:
    """When `tokens` query tokens can be done at the soonest: whole batches, then one cut.
    The cut is priced only when it ends before `deadline` (else the next whole batch does)."""
    budget = problem.budget
    whole, rest = divmod(max(tokens, 1), budget.batch_tokens)
    done = problem.now + whole * budget.period_s
    if not rest:
        return done
    if deadline >= done + budget.period_s:
        return done + budget.period_s
    return done + budget.seconds_for(problem.perf, rest)


def _events(problem: AdmissionProblem) -> tuple[list[tuple[float, int, int]], int]:
    """(time, kind, index) in deadline order, forced prefills (kind -1) before candidates
    (kind 0) at equal times; and how many running requests this budget cannot keep on time
    (those are planned as soon as possible)."""
    budget, now = problem.budget, problem.now
    period = budget.period_s
    events: list[tuple[float, int, int]] = []
    urgency = problem.decoders.next_deadline_s.copy()
    tpots = problem.decoders.tpot_s
    for i, chain in enumerate(problem.decoders.chains):
        if chain:
            urgency[i] = budget.chain_deadline(chain, float(tpots[i]), False)
    late = int(np.count_nonzero(urgency < now + period - _EPS))
    for i, p in enumerate(problem.prefills):
        deadline = budget.prompt_due(p.deadline_s, p.tpot_s, p.chain)
        earliest = _earliest(problem, p.prefill_tokens, deadline)
        late += deadline < earliest - _EPS
        events.append((max(deadline, earliest), -1, i))
    for j, c in enumerate(problem.candidates):
        events.append((budget.prompt_due(c.deadline_s, c.tpot_s, c.chain), 0, j))
    events.sort(key=lambda e: (e[0], e[1]))
    return events, late


def solve_admission(problem: AdmissionProblem, max_candidates: int = 0) -> AdmissionResult:
    """The most valuable feasible subset of the candidates (see the module docstring).

    With `max_candidates` > 0, a larger burst is decided in deadline-ordered groups of that
    size, each group's admitted requests forced into the next: the DP's grid grows with the
    product of per-tier counts, so this bounds planning time at a small loss of optimality.
    A budget whose batches overrun their period (`BatchBudget.overruns`) admits nothing."""
    if problem.budget.overruns and problem.candidates:
        return _decline_all(problem)
    if 0 < max_candidates < len(problem.candidates):
        return _solve_in_groups(problem, max_candidates)
    return _solve(problem)


def _solve_in_groups(problem: AdmissionProblem, size: int) -> AdmissionResult:
    budget = problem.budget
    ids = [c.request_id for c in problem.candidates]
    alone = _decline_all(problem)
    if not alone.keeps_running:  # no group could be admitted
        return alone
    ordered = sorted(
        problem.candidates,
        key=lambda c: budget.prompt_due(c.deadline_s, c.tpot_s, c.chain),
    )
    admitted: list[Candidate] = []
    for start in range(0, len(ordered), size):
        group = replace(
            problem,
            candidates=tuple(ordered[start : start + size]),
            prefills=problem.prefills
            + tuple(
                RunningPrefill(
                    c.prefill_tokens,
                    c.deadline_s,
                    c.tpot_s,
                    c.decode_tokens,
                    c.early_tokens,
                    c.chain,
                )
                for c in admitted
            ),
            free_blocks=problem.free_blocks - sum(c.blocks for c in admitted),
        )
        verdict = _solve(group)
        admitted += [c for c in group.candidates if verdict.is_admitted(c.request_id)]
    chosen = {c.request_id for c in admitted}
    return replace(
        alone,
        admitted=tuple(i for i in ids if i in chosen),
        declined=tuple(i for i in ids if i not in chosen),
        value=sum(c.value for c in admitted),
    )


def _decline_all(
    problem: AdmissionProblem,
    events: list[tuple[float, int, int]] | None = None,
    forced_late: int = 0,
) -> AdmissionResult:
    """The running requests' verdict on this budget, every candidate declined. `events`,
    `forced_late`: the problem's, from `_events`, when known (its running requests' events
    are those without the candidates', in the same order)."""
    alone = replace(problem, candidates=())
    if events is None:
        events, forced_late = _events(alone)
    running = [e for e in events if e[1] != 0]
    verdict = _solve_events(alone, running, forced_late)
    return replace(verdict, declined=tuple(c.request_id for c in problem.candidates))


def _solve(problem: AdmissionProblem) -> AdmissionResult:
    events, forced_late = _events(problem)
    if forced_late and problem.candidates:
        # A running request this budget leaves late (say its batches grew with the
        # candidates in them) is a promise broken: nothing new is promised on it.
        return _decline_all(problem, events, forced_late)
    return _solve_events(problem, events, forced_late)


def _solve_events(
    problem: AdmissionProblem, events: list[tuple[float, int, int]], forced_late: int
) -> AdmissionResult:
    budget = problem.budget
    batch = budget.batch_tokens
    times = np.array([e[0] for e in events], dtype=float)
    grid = _grid(problem, times)
    ks = grid.batches
    cut = budget.cut_tokens(problem.perf)
    forced = _forced_demand(problem, events, grid, cut)
    limit = grid.tokens - forced
    # Demand beyond the whole periods before an event needs a batch cut at it.
    whole_limit = grid.whole_tokens - forced
    charges = _acceptance_charges(problem, events, grid.next_end)
    # Values in integer micro-units, so equal totals compare equal whatever the order.
    values = [float(round(c.value * 1e6)) for c in problem.candidates]

    spec_lens, costs = {}, {}
    for tpot in {c.tpot_s for c in problem.candidates}:
        spec_lens[tpot] = budget.spec_len(tpot)
        costs[tpot] = budget.cost_per_batch(tpot)
    tiers = sorted(spec_lens)
    tier_of = {t: g for g, t in enumerate(tiers)}
    counts = [0] * len(tiers)
    for c in problem.candidates:
        counts[tier_of[c.tpot_s]] += 1

    unit = max(1, -(-problem.free_blocks // problem.memory_units))
    units = max(0, problem.free_blocks) // unit
    dims = [units + 1, *(n + 1 for n in counts)]
    size = int(np.prod(dims))
    coords = np.unravel_index(np.arange(size), dims)
    strides = [int(np.prod(dims[d + 1 :])) for d in range(len(dims))]
    rate = np.zeros(size)
    widest = np.zeros(size)
    for g, tpot in enumerate(tiers):
        rate += coords[g + 1] * costs[tpot]
        widest += coords[g + 1] * (spec_lens[tpot] + 1)

    cons = np.full(size, np.inf)
    value = np.full(size, -np.inf)
    cons[0], value[0] = 0.0, 0.0
    decisions: list[tuple[int, np.ndarray, int]] = []
    prev_k = 0
    for e, (_, kind, idx) in enumerate(events):
        cons += rate * float(ks[e] - prev_k)
        prev_k = int(ks[e])
        over = cons > limit[e] + _EPS
        cons[over], value[over] = np.inf, -np.inf
        if kind != 0:
            continue
        c = problem.candidates[idx]
        g = tier_of[c.tpot_s]
        need = -(-c.blocks // unit)
        if need > units:
            continue
        delta = need * strides[0] + strides[g + 1]
        add = c.prefill_tokens + charges[idx]
        take_cons = np.full(size, np.inf)
        take_value = np.full(size, -np.inf)
        take_cons[delta:] = cons[:-delta] + add
        take_value[delta:] = value[:-delta] + values[idx]
        valid = (coords[0] >= need) & (coords[g + 1] >= 1) & (take_cons <= limit[e] + _EPS)
        take_cons = np.where(take_cons > whole_limit[e] + _EPS, take_cons + cut, take_cons)
        take = valid & ((take_value > value) | ((take_value == value) & (take_cons < cons)))
        cons = np.where(take, take_cons, cons)
        value = np.where(take, take_value, value)
        decisions.append((idx, take, delta))

    decoders = problem.decoders
    forced_widest = float(
        np.sum((_spec_lens(budget, decoders.tpot_s) + 1) * (decoders.remaining_tokens > 0))
    ) + sum(budget.spec_len(p.tpot_s) + 1 for p in problem.prefills if p.decode_tokens > 0)
    feasible = np.isfinite(cons) & (forced_widest + widest <= batch + _EPS)
    ids = [c.request_id for c in problem.candidates]
    if not feasible[0]:
        return AdmissionResult((), tuple(ids), False, budget, 0.0, forced_late)
    best_value = value[feasible].max()
    best = int(np.argmin(np.where(feasible & (value == best_value), cons, np.inf)))
    chosen: set[int] = set()
    # Walked by slice: mypyc cannot compile unpacking in a loop over reversed().
    for idx, take, delta in decisions[::-1]:
        if take[best]:
            chosen.add(idx)
            best -= delta
    admitted = tuple(ids[j] for j in range(len(ids)) if j in chosen)
    declined = tuple(ids[j] for j in range(len(ids)) if j not in chosen)
    total = sum(problem.candidates[j].value for j in chosen)
    return AdmissionResult(admitted, declined, True, budget, total, forced_late)


def _forced_demand(
    problem: AdmissionProblem,
    events: Sequence[tuple[float, int, int]],
    grid: _Grid,
    cut: float,
) -> np.ndarray:
    """Tokens the running requests need done within the batches that end by each event, and
    `cut` for every batch boundary an earlier forced prompt needs off the period grid."""
    budget = problem.budget
    ks, grid_next_end = grid.batches, grid.next_end
    forced = np.array([kind == -1 for _, kind, _ in events], dtype=bool)
    prompts = np.array(
        [problem.prefills[i].prefill_tokens if kind == -1 else 0 for _, kind, i in events],
        dtype=float,
    )
    demand = np.cumsum(prompts)
    own_k = {i: ks[e] for e, (_, kind, i) in enumerate(events) if kind == -1}
    prefills = problem.prefills
    decoders = problem.decoders
    # Columns: first token due, tpot, token cap, batch its decoding starts in, spec length.
    first = np.concatenate(
        [
            [p.deadline_s + p.tpot_s for p in prefills],
            np.maximum(decoders.next_deadline_s, problem.now + budget.period_s),
        ]
    )[:, None]
    tpot = np.concatenate([[p.tpot_s for p in prefills], decoders.tpot_s])[:, None]
    cap = np.concatenate([[p.decode_tokens for p in prefills], decoders.remaining_tokens])[:, None]
    early = np.concatenate([[p.early_tokens for p in prefills], decoders.early_tokens])[:, None]
    start = np.concatenate([[own_k[i] for i in range(len(prefills))], np.zeros(len(decoders))])
    spec = _spec_lens(budget, tpot[:, 0])[:, None]
    ar = _ar_count(grid_next_end[None, :], first, tpot, cap, early)
    verifies = (spec + 1) * np.clip(ks[None, :] - start[:, None], 0, cap)
    demand = demand + np.where(spec > 0, verifies, ar).sum(axis=0)
    cuts = cut * (forced & (demand > grid.whole_tokens + _EPS))
    return demand + np.cumsum(cuts) - cuts


def _spec_lens(budget: BatchBudget, tpots: np.ndarray) -> np.ndarray:
    """The budget's speculation length for each TPOT (computed once per distinct TPOT)."""
    values = tpots.tolist()
    lens = {t: budget.spec_len(t) for t in set(values)}
    return np.array([lens[t] for t in values], dtype=float)


def _acceptance_charges(
    problem: AdmissionProblem,
    events: Sequence[tuple[float, int, int]],
    grid_next_end: np.ndarray,
) -> np.ndarray:
    """Decode tokens charged when accepting each candidate at its event, so that its charge
    plus its tier's per-batch rate afterwards bounds its true decode demand at every later
    event (0 for speculating tiers, which are charged per batch from their start)."""
    cands = problem.candidates
    if not cands:
        return np.zeros(0)
    at = np.zeros(len(cands), dtype=np.int64)
    for e, (_, kind, idx) in enumerate(events):
        if kind == 0:
            at[idx] = e
    tpot = np.array([c.tpot_s for c in cands])[:, None]
    first = np.array([c.deadline_s for c in cands])[:, None] + tpot
    cap = np.array([c.decode_tokens for c in cands], dtype=float)[:, None]
    early = np.array([c.early_tokens for c in cands], dtype=float)[:, None]
    fluid = (grid_next_end[None, :] - first) / tpot
    exact = _ar_count(grid_next_end[None, :], first, tpot, cap, early)
    later = np.arange(len(events))[None, :] >= at[:, None]
    worst = np.where(later, exact - fluid, -np.inf).max(axis=1)
    charge = fluid[np.arange(len(cands)), at] + worst
    return np.where(_spec_lens(problem.budget, tpot[:, 0]) > 0, 0.0, charge)
