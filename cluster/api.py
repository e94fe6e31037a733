"""The contract between the front door (router) and the cluster.

`ClusterHandle.submit(request)` yields `TokenChunk`s as the replica produces them (the first
one says where the request was bound, so a front door can tell its client before the end) and
ends with exactly one `FinalRecord`, which says what the cluster did with the request
(admitted, served best-effort, or rejected), where, after how many hops, and whether each SLO
stage was met.
Token ids only: the router tokenizes and detokenizes, the cluster never needs a tokenizer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from replica.batch import TokenLogprob
from replica.planner.deadlines import ON_TIME_SLACK_S, late_tokens
from replica.request import Request


class Verdict(StrEnum):
    ADMITTED = "admitted"
    BEST_EFFORT = "best_effort"
    REJECTED = "rejected"


class ClusterUnavailable(RuntimeError):
    """No replica is up (HTTP 503 / gRPC UNAVAILABLE); the request was not started."""

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Placement:
    """Where the controller bound a request: known with its first token, long before the end."""

    verdict: Verdict
    replica: int | None
    """None only in a summary over several choices bound to different replicas (the SDK's
    first chunk of an n > 1 stream)."""
    hops: int
    """Replicas tried, the bound one included."""


@dataclass(frozen=True)
class TokenChunk:
    """New output tokens of one request, in order, never repeated (also across migrations)."""

    request_id: str
    token_ids: tuple[int, ...]
    times: tuple[float, ...]
    """Wall-clock time (time.time()) each token was produced."""
    placement: Placement | None = None
    """Set on the first chunk from each replica the request is bound to (after a migration,
    the new one); None on the others."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token, when the request's sampling asked for them (`logprobs`)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """With the first token, when the request's sampling asked for them (`prompt_logprobs`):
    one per prompt token after the first."""


@dataclass(frozen=True)
class StageVerdict:
    """Whether one SLO stage was met under deadline semantics (token j by its deadline)."""

    name: str
    attained: bool
    late_tokens: int
    tokens: int = 0
    """Output tokens the stage covered (a stage that ends on a token: where the model ended
    it, say a reasoning model's thinking length)."""


def stage_verdicts(
    request: Request,
    tokens: Sequence[int],
    times: Sequence[float],
    cut_at: float | None = None,
) -> tuple[StageVerdict, ...]:
    """Per SLO stage: token j on time iff it came by arrival + deadline_s(j) (within a
    nanosecond, as the load generator judges: `late_tokens`), the stages that end on a token
    closed where `tokens` (the output) has it. `cut_at`: when an output stopped short (its
    client left, its replica was lost): its next token, due by then, misses its stage too,
    so a client that gave up waiting is not counted as served on time; the stages it never
    reached are left out."""
    if request.slo is None:
        return ()
    slo = request.slo.closed_by(tokens)
    names = [st.name or f"stage{i}" for i, st in enumerate(slo.stages)] or ["default"]
    late = Counter(slo.stage_at(j) for j in late_tokens(request, times, tokens))
    count = Counter(slo.stage_at(j) for j in range(len(times)))
    nxt = len(times)
    overdue = (
        cut_at is not None
        and nxt < request.sampling.max_tokens
        and cut_at > request.arrival_time + slo.deadline_s(nxt) + ON_TIME_SLACK_S
    )
    missed = slo.stage_at(nxt) if overdue else -1
    return tuple(
        StageVerdict(name, not late[i] and i != missed, late[i], count[i])
        for i, name in enumerate(names)
        if cut_at is None or count[i] or i == missed
    )


@dataclass(frozen=True)
class FinalRecord:
    """The one last item of every submit stream."""

    request_id: str
    verdict: Verdict
    replica: int | None
    hops: int
    finish_reason: str | None = None
    """length | stop | abort; None for a rejected request."""
    reason: str = ""
    """Why a request was rejected or aborted."""
    retry_after_s: float = 0.0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Of the prompt, tokens the replica's prefix cache held (0 without the cache)."""
    num_output_tokens: int = 0
    migrations: int = 0
    stages: tuple[StageVerdict, ...] = ()

    @property
    def slo_attained(self) -> bool | None:
        """All stages met; None when the request had no SLO (best-effort by choice)."""
        return all(s.attained for s in self.stages) if self.stages else None


@dataclass(frozen=True)
class ReplicaStatus:
    replica: int
    alive: bool
    running: int
    waiting: int
    admitted: int
    best_effort: int
    kv_usage: float
    """Fraction of KV blocks in use."""
    calibration: dict[str, float] = field(default_factory=dict)
    """Measured / predicted step time per shape class (decode, mixed, prefill, speculative)
    the controller plans this replica with; empty until a step is observed or for baselines.
    Above 1: the replica runs slower than its profile."""
    draining: bool = False
    """The autoscaler is stopping it: it finishes what it holds and takes nothing new."""


@dataclass(frozen=True)
class ClusterStatus:
    model: str
    replicas: tuple[ReplicaStatus, ...]
    counters: dict[str, int] = field(default_factory=dict)
    """admitted, best_effort, rejected, routed, migrated, preempted, demoted, promoted (since
    start)."""
    scheduler: str = ""
    """What plans the replicas: slos, or a baseline (vllm, sarathi) that admits everything;
    empty where the source does not say."""
    target_replicas: int = 0
    """The replica count the autoscaler aims at (0: no autoscaler; `replicas` lists the
    replicas up, draining ones included)."""
    starting: int = 0
    """Replicas being started (loading their model): the autoscaler's, or in the slot of one
    dead for good."""
    start_error: str = ""
    """Why the last replica start failed, until one succeeds or, autoscaled, no replica is
    wanted any more (empty: none is failing); a failed start is tried again
    (cluster.controller.START_RETRY_S)."""
