"""Where a request stands against its SLO line (deadline semantics, absolute seconds)."""

from __future__ import annotations

from collections.abc import Sequence

from replica.request import SLO, Request

ON_TIME_SLACK_S = 1e-9
"""A token this little past its deadline is on time: float round-off, not lateness."""


def _slo(request: Request) -> SLO:
    if request.slo is None:
        raise ValueError(f"request {request.request_id!r} has no SLO")
    return request.slo


def token_deadline(request: Request, j: int) -> float:
    """Absolute time by which output token j (0-based) must be out."""
    return request.arrival_time + _slo(request).deadline_s(j)


def prefill_deadline(request: Request) -> float:
    """The first token's deadline: the prompt must be fully computed by then."""
    return token_deadline(request, 0)


def remaining_tpot(request: Request, j: int) -> float:
    """The tightest TPOT (seconds) governing token j or any later token.

    A multi-stage request is planned with the tightest stage still ahead of it, so a tight
    thinking stage bounds its demand until the stage ends, and a loose answer stage after it."""
    slo = _slo(request)
    return slo.tightest_tpot_ms(slo.stage_at(j)) / 1e3


def early_stage_starts(request: Request, after: int) -> int:
    """Stages after the one of token `after` that start sooner than one `remaining_tpot`
    (from token after + 1 on) after the previous stage's last deadline, i.e. with an explicit
    short stage TTFT. Each lets at most one token fall due earlier than even spacing at that
    TPOT from token after + 1, so plans count one more token per such stage."""
    slo = _slo(request)
    if not slo.stages:
        return 0
    tpot_ms = remaining_tpot(request, after + 1) * 1e3
    later = slo.stages[slo.stage_at(after) + 1 :]
    return sum(1 for stage in later if stage.ttft_ms is not None and stage.ttft_ms < tpot_ms)


CHAIN_WINDOW = 8
"""Tokens ahead considered when a stage that starts early crowds deadlines together."""


def upcoming_deadlines(request: Request, first: int) -> tuple[float, ...]:
    """Deadlines of tokens first, first + 1, ... (up to CHAIN_WINDOW, within max_tokens)."""
    last = min(first + CHAIN_WINDOW, request.sampling.max_tokens)
    return tuple(token_deadline(request, j) for j in range(first, last))


def chain_deadline(deadlines: tuple[float, ...], first_s: float, pace_s: float) -> float:
    """When the first of `deadlines` must be out so that the rest are on time too: the next
    one `first_s` after it, then one every `pace_s` (`BatchBudget.chain_deadline` says
    which)."""
    due = deadlines[0]
    for m in range(1, len(deadlines)):
        due = min(due, deadlines[m] - first_s - (m - 1) * pace_s)
    return due


def chain_period(deadlines: tuple[float, ...], start: float) -> float:
    """The longest batch period at which batches back to back from `start`, one of
    `deadlines` each, are all on time."""
    return min((d - start) / (m + 1) for m, d in enumerate(deadlines))


def late_tokens(request: Request, times: Sequence[float], output: Sequence[int] = ()) -> list[int]:
    """Output positions that came out after their deadline (deadline semantics), the SLO's
    stages closed where `output` (the tokens) ends them; none without an SLO."""
    if request.slo is None:
        return []
    slo = request.slo.closed_by(output)
    arrival = request.arrival_time
    return [j for j, t in enumerate(times) if t > arrival + slo.deadline_s(j) + ON_TIME_SLACK_S]
