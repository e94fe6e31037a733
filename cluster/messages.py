"""What replicas and the controller tell each other (plain dataclasses, pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from replica.batch import BatchOutcome, BatchPlan, TokenLogprob
from replica.request import Request


class AlreadyHeld(ValueError):
    """A replica was handed a request it holds (a retried submit, or a controller restarted
    during the hand-off sends it again): the request is where it should be."""


@dataclass(frozen=True)
class StepReport:
    """One executed step. `seq` counts steps of this replica incarnation from 1, so the
    controller can tell a report it already folded in (after a rebuild) from a lost one."""

    replica: int
    incarnation: str
    seq: int
    plan: BatchPlan
    """The plan as executed (after reconciliation), not as sent."""
    outcome: BatchOutcome
    time: float
    prefix_queries: int = 0
    """Known tokens of the requests this step began to prefill (new, or preempted) that the
    prefix cache was asked for (0 without the cache)."""
    prefix_hits: int = 0
    """Of those, the tokens the cache held: computed by an earlier request, not this step."""

    @property
    def executed(self) -> bool:
        """False for an abort report: a step with no work, sent so the mirror drops requests."""
        return bool(self.plan.entries)


@dataclass(frozen=True)
class HeldRequest:
    """A request a replica holds, with the progress that survives a controller restart."""

    request: Request
    admitted: bool
    """True: admitted with an SLO guarantee; False: best-effort."""
    output_token_ids: tuple[int, ...]
    num_computed: int


@dataclass(frozen=True)
class ReplicaSnapshot:
    """Everything a replica holds after step `seq` of `incarnation`."""

    replica: int
    incarnation: str
    seq: int
    requests: tuple[HeldRequest, ...]
    free_blocks: int
    num_blocks: int
    ended: tuple[str, ...] = ()
    """Requests this incarnation ended lately (replica_core.ENDED_MEMORY of them): a request
    being bound when the snapshot was taken is missing from it either because its hand-off
    had not reached the replica yet or because it already ended, and only the first is put
    back in the mirror."""


@dataclass(frozen=True)
class StreamItem:
    """New tokens of one request; the last item carries the finish reason. `lost` says the
    replica does not hold the request (it restarted): the client resumes it elsewhere."""

    token_ids: tuple[int, ...] = ()
    times: tuple[float, ...] = ()
    finish_reason: str | None = None
    abort_reason: str = ""
    """Why the replica ended the request as aborted, when it did (RequestOutcome's)."""
    lost: bool = False
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token, when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """With the first token, when the request asked for them: one per prompt token after
    the first."""
    cached_tokens: int = 0
    """With the first token: the prompt tokens the replica's prefix cache held (computed by
    an earlier request), OpenAI's `usage.prompt_tokens_details.cached_tokens`."""
    promoted: bool = False
    """The request, bound best-effort, is guaranteed since (a replan of its replica found
    room for it): its verdict is admitted. Said once, mostly with the first token (the
    controller's copy of the replica lags it by a step, so a promotion may come later)."""
