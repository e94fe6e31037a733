"""Resuming a request elsewhere: the tokens it already delivered become prompt.

A replica that dies mid-stream loses its KV, not the request: the client knows every token it
received, so another replica continues from prompt + delivered with a shorter budget. The SLO
line is shifted so each remaining token keeps the deadline it had at the original arrival: the
request is not granted fresh slack by the failure, nor punished for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from replica.request import SLO, Request, Stage


def shift_slo(slo: SLO, delivered: int) -> SLO:
    """The SLO whose token j is due when the original's token `delivered + j` was (same arrival)."""
    if delivered < 0:
        raise ValueError(f"delivered must be >= 0, got {delivered}")
    if delivered == 0:
        return slo
    first_ms = slo.deadline_s(delivered) * 1e3
    if not slo.stages:
        return SLO(ttft_ms=first_ms, tpot_ms=slo.tpot_ms)
    index = slo.stage_at(delivered)
    current = slo.stages[index]
    remaining = (
        None
        if current.num_tokens is None
        else current.num_tokens - (delivered - slo.stage_start(index))
    )
    if remaining is not None and remaining <= 0:
        # Past the last bounded stage: only the unbounded tail at its TPOT remains.
        stages: tuple[Stage, ...] = (Stage(tpot_ms=current.tpot_ms, name=current.name),)
    else:
        stages = (replace(current, num_tokens=remaining), *slo.stages[index + 1 :])
    return SLO(ttft_ms=first_ms, tpot_ms=stages[0].tpot_ms, stages=stages)


def resumed_request(original: Request, delivered: Sequence[int]) -> Request:
    """`original` continued after `delivered` output tokens (same id, arrival and deadlines)."""
    count = len(delivered)
    if count >= original.sampling.max_tokens:
        raise ValueError(
            f"request {original.request_id!r} already delivered {count} of "
            f"{original.sampling.max_tokens} tokens; nothing is left to resume"
        )
    return replace(
        original,
        prompt_token_ids=[*original.prompt_token_ids, *delivered],
        sampling=replace(
            original.sampling,
            max_tokens=original.sampling.max_tokens - count,
            min_tokens=max(0, original.sampling.min_tokens - count),
            # The client has them once a token came (they come with the first).
            prompt_logprobs=original.sampling.prompt_logprobs if count == 0 else None,
        ),
        slo=None if original.slo is None else shift_slo(original.slo.closed_by(delivered), count),
        resumed_output=original.resumed_output + count,
    )
