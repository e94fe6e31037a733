"""Batch formation from the admitted set: EDF over decode tokens and prefill chunks.

One batch holds at most `batch_tokens` query tokens, so it ends within the period. SLO work
comes first, earliest deadline first: every prompt chunk of an admitted request (keyed by its
prefill deadline) and every decode whose next token is due before the end of the next batch
(keyed by that deadline). Decodes not yet due ride ahead of their line in the time the batch
has left within its period (a budget may leave them out of its worst case, see
`SlosScheduler._budgets`), less one token of the best-effort tier's head, which always
progresses. Then best-effort work, in the scheduler's order, in the memory not reserved for
admitted requests and in `best_effort_stretch` of the SLO work's time: it never slows the
admitted decoders by more than that, because a decoder slowed holds its KV longer. Neither
the riders nor best-effort work may carry the batch past the deadline of a token it owes.
Best-effort requests holding memory that admitted requests may need are preempted (KV
dropped, tokens kept). If a due decode is closer than a period (the period grew, or the
request fell behind), or a prompt due sooner than a period can be finished by its deadline,
the batch shrinks to reach it in time when it can; its prompts then take what the batch as
formed fits by then.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from replica.batch import BatchPlan, DecodeStep, PlanEntry, PrefillChunk
from replica.perf_model import BatchTimeModel, attention_pairs
from replica.planner.base import CacheBudget, RequestState
from replica.planner.budget import BatchBudget, expected_tokens
from replica.planner.deadlines import (
    early_stage_starts,
    remaining_tpot,
    token_deadline,
    upcoming_deadlines,
)
from replica.planner.invocation import lags
from replica.planner.queues import RequestQueues, peak_tokens


@dataclass(slots=True)
class SloWork:
    """An admitted request as the plan holds it: its TPOT and its EDF key.

    Kept per request and refreshed only when the request or the budget changes, because
    recomputing deadlines for hundreds of running requests every batch is the planner's
    largest cost."""

    state: RequestState
    base_tpot_s: float
    """Tightest TPOT of the stages ahead."""
    tpot_s: float
    """The TPOT the plan holds it to (tighter while behind)."""
    decoding: bool
    early_tokens: int
    """Tokens ahead that may fall due sooner than even TPOT spacing (`early_stage_starts`)."""
    urgency_s: float
    """EDF key: the next token's deadline, or the prompt's (`BatchBudget.prompt_due`), or
    earlier before a stage that starts early (`chain_deadline`)."""
    peak_tokens: int
    """KV slots it may hold at its longest (prompt + max_tokens - 1)."""
    reserve_tokens: int
    """KV slots reserved for it now (peak_tokens unless reservations follow an estimate)."""
    produced: int = -1
    """Tokens produced when `decoding`, `token_deadline_s` and `chain` were last computed:
    every replan refreshes every admitted request, most of them unchanged since the last."""
    token_deadline_s: float = 0.0
    """Deadline of the next token (the prompt's, before the first)."""
    chain: tuple[float, ...] = ()
    """Deadlines of the tokens ahead while a stage may start early (`upcoming_deadlines`),
    else empty."""

    def refresh(self, now: float, budget: BatchBudget | None, behind_factor: float) -> None:
        """Recompute from the request's progress, the budget (None: none planned yet) and
        the time."""
        period_s = budget.period_s if budget is not None else 0.0
        state = self.state
        produced = len(state.output_token_ids)
        decoding = state.is_decoding
        if produced != self.produced or decoding != self.decoding:
            self._track(produced, decoding)
        self.urgency_s = self.token_deadline_s
        if decoding:
            behind = lags(self.token_deadline_s, now, period_s)
            self.tpot_s = self.base_tpot_s * (behind_factor if behind else 1.0)
            if self.early_tokens and budget is not None:  # no budget: period 0, none moves
                chained = budget.chain_deadline(self.chain, self.tpot_s, False)
                self.urgency_s = min(self.urgency_s, chained)
        else:
            self.tpot_s = self.base_tpot_s
            if budget is not None:
                self.urgency_s = budget.prompt_due(self.token_deadline_s, self.tpot_s, self.chain)

    def _track(self, produced: int, decoding: bool) -> None:
        """What depends only on the request's progress."""
        request = self.state.request
        self.produced = produced
        self.decoding = decoding
        self.base_tpot_s = remaining_tpot(request, max(1, produced))
        # A decoder's next deadline is exact; before the first token, token 1 is assumed one
        # TPOT after token 0, so a stage starting early right after token 0 counts too. A
        # request computing its prompt and output again counts from its next token, as its
        # chain does.
        self.early_tokens = early_stage_starts(request, produced)
        self.token_deadline_s = token_deadline(request, produced)
        self.chain = upcoming_deadlines(request, produced) if self.early_tokens else ()

    @classmethod
    def of(
        cls,
        state: RequestState,
        now: float,
        budget: BatchBudget | None,
        behind_factor: float,
        reserve_tokens: int | None = None,
    ) -> SloWork:
        peak = peak_tokens(state.request)
        reserve = peak if reserve_tokens is None else reserve_tokens
        work = cls(state, 0.0, 0.0, False, 0, 0.0, peak, reserve)
        work.refresh(now, budget, behind_factor)
        return work


@dataclass
class _Step:
    """The batch being formed, with the aggregate features the perf model prices it by."""

    tokens_left: int
    entries: list[PlanEntry]
    num_tokens: int = 0
    attn_tokens: int = 0
    kv_tokens: int = 0
    draft_steps: int = 0
    draft_batch: int = 0

    def decode(self, state: RequestState, spec: int) -> int | None:
        """Add a decode speculating at most `spec` drafts; the drafts it got (None: no room)."""
        if self.tokens_left < 1:
            return None
        k = _draft_len(spec, state.remaining_output, self.tokens_left)
        self.entries.append(DecodeStep(state.request_id, k))
        self._count(k + 1, state.num_computed_tokens)
        if k > 0:
            self.draft_steps = max(self.draft_steps, k)
            self.draft_batch += 1
        return k

    def prefill(self, state: RequestState, limit: int) -> int:
        """Add a prompt chunk of at most `limit` tokens; the tokens it got."""
        n = min(state.num_uncomputed, self.tokens_left, limit)
        if n >= 1:
            self.entries.append(PrefillChunk(state.request_id, n))
            self._count(n, state.num_computed_tokens)
        return n

    def prefill_by(self, state: RequestState, perf: BatchTimeModel, seconds: float) -> int:
        """A prompt in a batch cut short at a deadline: what the token count leaves, or more
        if the batch's own price still ends within `seconds`. The count prices the budget's
        worst-case batch, as the admission DP plans; the batch as formed is often cheaper,
        and a prompt due soon after the cut, with no time for a batch of its own, then
        finishes in it rather than late (room the plans do not count on)."""
        left = state.num_uncomputed
        n = min(left, self.tokens_left)
        if n < left:
            context = state.num_computed_tokens
            n = max(n, min(left, self.prefill_within(perf, seconds, context, left)))
        if n >= 1:
            self.entries.append(PrefillChunk(state.request_id, n))
            self._count(n, state.num_computed_tokens)
            self.tokens_left = max(0, self.tokens_left)  # past the count: the batch is full
        return n

    def _count(self, new_tokens: int, context: int) -> None:
        self.tokens_left -= new_tokens
        self.num_tokens += new_tokens
        self.attn_tokens += attention_pairs(new_tokens, context)
        self.kv_tokens += new_tokens + context

    def seconds(self, perf: BatchTimeModel) -> float:
        """Predicted time of the batch as it stands."""
        return perf.predict_aggregate(
            num_tokens=self.num_tokens,
            num_requests=len(self.entries),
            attn_tokens=self.attn_tokens,
            kv_tokens=self.kv_tokens,
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
        )

    def seconds_with(self, perf: BatchTimeModel, new_tokens: int, context: int) -> float:
        """Predicted time of the batch with one more request of `new_tokens` on `context`."""
        return perf.predict_aggregate(
            num_tokens=self.num_tokens + new_tokens,
            num_requests=len(self.entries) + 1,
            attn_tokens=self.attn_tokens + attention_pairs(new_tokens, context),
            kv_tokens=self.kv_tokens + new_tokens + context,
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
        )

    def prefill_within(self, perf: BatchTimeModel, seconds: float, context: int, most: int) -> int:
        """Prompt tokens (at most `most`) one more request on `context` may add to the batch
        with its predicted time still within `seconds`."""
        return perf.max_new_tokens_within(
            seconds,
            num_requests=len(self.entries) + 1,
            base_tokens=self.num_tokens,
            base_attn_tokens=self.attn_tokens,
            context_per_new_token=context + most,
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
            base_kv_tokens=self.kv_tokens + context,
        )


def form_batch(
    now: float,
    budget: BatchBudget,
    perf: BatchTimeModel,
    slo: Sequence[SloWork],
    best_effort: Sequence[RequestState],
    queues: RequestQueues,
    reserved_blocks: int,
    max_best_effort: int,
    best_effort_stretch: float,
    ride_spec_tokens: int = 0,
) -> BatchPlan | None:
    """The next step: SLO work by deadline, then best-effort work in what is left.

    `reserved_blocks` are the admitted requests' KV blocks at their longest."""
    period = budget.period_s
    horizon = now + 2 * period
    due: list[tuple[float, SloWork]] = []
    later: list[tuple[float, SloWork]] = []
    for work in slo:
        if work.decoding:
            (due if work.urgency_s < horizon else later).append((work.urgency_s, work))
        elif work.state.num_uncomputed > 0:
            due.append((work.urgency_s, work))
    due.sort(key=lambda item: item[0])
    later.sort(key=lambda item: item[0])

    spec_lens = {tpot: budget.spec_len(tpot) for tpot in {w.tpot_s for _, w in due + later}}
    tokens = budget.batch_tokens
    seconds = _cut_at(now, budget, perf, due, spec_lens)
    if seconds < period:
        tokens = budget.tokens_within(perf, seconds) or tokens
    step = _Step(tokens, [])
    # Work beside the tokens the batch owes (the next of each decode in it, the first of each
    # prompt it finishes) rides only in the time before the first falls due, so decoders
    # ahead of their line and best-effort requests never make an admitted token late.
    owed = math.inf
    for _, work in due:
        state = work.state
        if work.decoding:
            placed = step.decode(state, spec_lens[work.tpot_s]) is not None
        elif seconds < period:
            placed = step.prefill_by(state, perf, seconds) == state.num_uncomputed
        else:
            placed = step.prefill(state, step.tokens_left) == state.num_uncomputed
        if placed:
            owed = min(owed, work.token_deadline_s)
    seconds = min(seconds, owed - now)
    ahead = seconds
    if best_effort:
        # The tier's head gets a token in every batch that has room for one (so it always
        # progresses): decoders ahead of their line ride in the time left beside it.
        head = best_effort[0].num_computed_tokens
        ahead -= step.seconds_with(perf, 1, head) - step.seconds(perf)
    riders = [work for _, work in later]
    accept = budget.acceptance
    _ride_ahead(step, riders, spec_lens, perf, ahead, accept, ride_spec_tokens)
    spare = seconds
    if step.entries:
        spare = min(seconds, step.seconds(perf) * (1.0 + best_effort_stretch))
    preempt = _fill_best_effort(
        step, best_effort, queues, reserved_blocks, max_best_effort, perf, spare, seconds
    )
    if not step.entries and not preempt:
        if best_effort:
            # The head got nothing (its memory is held for admitted requests): the riders
            # take its time rather than leave the replica idle.
            _ride_ahead(step, riders, spec_lens, perf, seconds, accept, ride_spec_tokens)
        if not step.entries:
            return None
    return BatchPlan(entries=tuple(step.entries), preempt=tuple(preempt))


def _cut_at(
    now: float,
    budget: BatchBudget,
    perf: BatchTimeModel,
    due: Sequence[tuple[float, SloWork]],
    spec_lens: dict[float, int],
) -> float:
    """How long the batch may run: a period, or less to reach a due decode closer than that,
    or the deadline of a prompt closer than that which a batch cut there finishes (the
    admission DP counts on such cuts, see replica.planner.admission). `due` is in deadline
    order."""
    cut = budget.period_s
    queued = 0
    for deadline, work in due:
        left = deadline - now
        if left >= cut:
            break
        if work.decoding:
            queued += 1 + spec_lens[work.tpot_s]
            if left > 0:
                cut = left
        else:
            queued += work.state.num_uncomputed
            if left > 0 and queued <= budget.tokens_within(perf, left):
                cut = left
    return cut


def _ride_ahead(
    step: _Step,
    ahead: Sequence[SloWork],
    spec_lens: dict[float, int],
    perf: BatchTimeModel,
    seconds: float,
    acceptance: float,
    longest: int,
) -> None:
    """Decoders not yet due, by deadline, as many as the batch holds within `seconds`: a
    budget may leave out decoders far ahead of their line (`SlosScheduler._budgets`), so
    tokens alone do not bound the batch's time. With `longest` > 0 they may speculate up to
    that many drafts beyond the budget's lengths, at the one length that delivers them the
    most tokens per second of the batch: tokens nobody promised, which free their KV sooner."""
    if not ahead:
        return
    specs = [spec_lens[w.tpot_s] for w in ahead]
    remaining = [w.state.remaining_output for w in ahead]
    contexts = [w.state.num_computed_tokens for w in ahead]
    best: tuple[float, _Ride | None, int] = (-1.0, None, 0)
    tried: set[tuple[int, ...]] = set()
    # A length no longer than every decoder's own drafts what length 0 does.
    for extra in (0, *range(min(specs) + 1, longest + 1)):
        drafts = _ride_drafts(specs, remaining, step.tokens_left, extra)
        if drafts in tried:
            continue  # the same batch as a shorter length's, which keeps the tie
        tried.add(drafts)
        ride = _Ride(step, contexts, drafts)
        fits, took = ride.longest_within(perf, seconds)
        rate = ride.expected(fits, acceptance) / took
        if rate > best[0] * (1.0 + 1e-9):
            best = (rate, ride, fits)
    _, chosen, fits = best
    assert chosen is not None  # every rate beats -1
    chosen.add(step, [work.state.request_id for work in ahead[:fits]])


_Sums = tuple[int, int, int, int, int]
"""A batch's num_tokens, attn_tokens, kv_tokens, draft_steps and draft_batch."""


def _ride_drafts(
    specs: Sequence[int], remaining: Sequence[int], tokens_left: int, least: int
) -> tuple[int, ...]:
    """The drafts of decoders ahead of their line added in order as decodes speculating at
    least `least`, as `_Step.decode` adds them, until the batch's tokens run out (the rest
    get no token). `specs` and `remaining`: each one's spec length and remaining output."""
    drafts: list[int] = []
    left = tokens_left
    for spec, rest in zip(specs, remaining, strict=True):
        if left < 1:
            break
        k = _draft_len(max(spec, least), rest, left)
        left -= k + 1
        drafts.append(k)
    return tuple(drafts)


class _Ride:
    """Decoders ahead of their line added in order to `step` with the given drafts, but
    first only as the batch's features: `_ride_ahead` weighs every speculation length and
    keeps one, and planning runs this for every batch of every replica, so the batch is
    running sums, not entries, and the sums after each prefix are built only when not every
    decoder fits (rarely). `contexts`: each decoder's cached context."""

    def __init__(self, step: _Step, contexts: Sequence[int], drafts: Sequence[int]) -> None:
        self.num_ahead = len(contexts)
        self.requests = len(step.entries)
        self.base: _Sums = (
            step.num_tokens,
            step.attn_tokens,
            step.kv_tokens,
            step.draft_steps,
            step.draft_batch,
        )
        self.contexts = contexts
        self.drafts = drafts
        self.total = self._added(self.base, 0, len(self.drafts))
        self.prefixes: list[_Sums] = []
        """The sums after each prefix of the drafts' decoders (`sums`)."""

    def _added(self, sums: _Sums, start: int, stop: int) -> _Sums:
        """`sums` with the decoders `start` to `stop` added."""
        tokens, attn, kv, draft_steps, draft_batch = sums
        for k, context in zip(self.drafts[start:stop], self.contexts[start:stop], strict=True):
            tokens += k + 1
            attn += attention_pairs(k + 1, context)
            kv += k + 1 + context
            if k > 0:
                draft_steps = max(draft_steps, k)
                draft_batch += 1
        return tokens, attn, kv, draft_steps, draft_batch

    def sums(self, count: int) -> tuple[int, _Sums]:
        """How many decoders of the first `count` get a token, and the batch's sums with them."""
        i = min(count, len(self.drafts))
        if i == len(self.drafts):
            return i, self.total
        if not self.prefixes:
            self.prefixes.append(self.base)
            for j in range(len(self.drafts)):
                self.prefixes.append(self._added(self.prefixes[-1], j, j + 1))
        return i, self.prefixes[i]

    def seconds(self, perf: BatchTimeModel, count: int) -> float:
        """Predicted time of the batch with the first `count` decoders added."""
        i, (tokens, attn, kv, draft_steps, draft_batch) = self.sums(count)
        return perf.predict_aggregate(
            num_tokens=tokens,
            num_requests=self.requests + i,
            attn_tokens=attn,
            kv_tokens=kv,
            draft_steps=draft_steps,
            draft_batch=draft_batch,
        )

    def expected(self, count: int, acceptance: float) -> float:
        """Tokens the first `count` decoders are expected to deliver."""
        return sum((expected_tokens(acceptance, k) for k in self.drafts[:count]), 0.0)

    def longest_within(self, perf: BatchTimeModel, seconds: float) -> tuple[int, float]:
        """How many decoders, in order, the batch takes and still ends within `seconds`, and
        the batch's time with them."""
        fits = self.num_ahead
        took = self.seconds(perf, fits)
        if took > seconds:
            fits, over, took = 0, fits, self.seconds(perf, 0)
            while over - fits > 1:
                mid = (fits + over) // 2
                mid_s = self.seconds(perf, mid)
                if mid_s <= seconds:
                    fits, took = mid, mid_s
                else:
                    over = mid
        return fits, took

    def add(self, step: _Step, request_ids: Sequence[str]) -> None:
        """Add the first decoders (`request_ids`, in order) to `step`."""
        i, sums = self.sums(len(request_ids))
        step.entries.extend(map(DecodeStep, request_ids[:i], self.drafts[:i]))
        step.tokens_left -= sums[0] - step.num_tokens
        step.num_tokens, step.attn_tokens, step.kv_tokens = sums[:3]
        step.draft_steps, step.draft_batch = sums[3:]


def _draft_len(spec: int, remaining_output: int, tokens_left: int) -> int:
    """Drafts a decode asking for `spec` gets in a batch with `tokens_left` (>= 1) query
    tokens left: none past its output's end, and its own token always fits."""
    return max(0, min(spec, remaining_output - 1, tokens_left - 1)) if spec else 0


def _fill_best_effort(
    step: _Step,
    best_effort: Sequence[RequestState],
    queues: RequestQueues,
    reserved: int,
    max_best_effort: int,
    perf: BatchTimeModel,
    spare: float,
    seconds: float,
) -> list[str]:
    """Schedule best-effort work in the given order, in memory not reserved by admitted
    requests, within the `spare` time the SLO work leaves: the first request always gets a
    token while the batch stays within `seconds` (so the tier progresses), the rest only what
    fits in `spare`.

    The holders last in that order are preempted when admitted requests' reservations need
    their blocks, or when one ahead of them cannot grow otherwise (so the tier never
    deadlocks). Returns the preempted ids."""
    cache = queues.budget
    running = set(queues.running)
    holders = [s for s in best_effort if s.request_id in running]
    position = {s.request_id: i for i, s in enumerate(holders)}
    free = cache.num_blocks - reserved - sum(queues.held_blocks(s) for s in holders)
    preempt: list[str] = []

    def evict_last(after: int) -> bool:
        nonlocal free
        for state in reversed(holders[after:]):
            if state.request_id not in preempt:
                preempt.append(state.request_id)
                free += queues.held_blocks(state)
                return True
        return False

    while free < 0 and evict_last(0):
        pass
    scheduled = 0
    for state in best_effort:
        if step.tokens_left < 1 or scheduled >= max_best_effort:
            break
        if state.request_id in preempt:
            continue
        held = state.num_computed_tokens
        holds = queues.blocks_of(state, running)
        younger = position.get(state.request_id, len(holders) - 1) + 1
        while _fits(cache, held, holds, free) < 1 and evict_last(younger):
            pass
        want = 1 if state.is_decoding else min(state.num_uncomputed, step.tokens_left)
        n = min(want, _fits(cache, held, holds, free))
        if n < 1:
            continue
        if state.is_decoding:
            n = int(step.seconds_with(perf, 1, held) <= spare)
        else:
            n = min(n, step.prefill_within(perf, spare, held, n))
        if (
            n < 1
            and not scheduled
            and (not step.entries or step.seconds_with(perf, 1, held) <= seconds)
        ):
            n = 1
        if n < 1:
            if scheduled and step.seconds_with(perf, 1, 0) > spare:
                break  # not even a bare token fits the time left
            continue
        if state.is_decoding:
            step.decode(state, 0)
        else:
            step.prefill(state, n)
        free -= cache.blocks_for(held + n) - holds
        scheduled += 1
    return preempt


def _fits(cache: CacheBudget, held: int, holds: int, free_blocks: int) -> int:
    """Tokens a request with `held` slots computed in `holds` blocks of its own can add."""
    return (holds + free_blocks) * cache.block_size - held
