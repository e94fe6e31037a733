"""The one contract between a scheduler and the engine: a plan in, an outcome out.

There is no prefill phase: each request has computed tokens catching up to its known tokens
(prompt + generated). A plan entry either feeds the next `num_tokens` known tokens (a prefill
chunk, which may also be a resume after preemption) or decodes one token, optionally with
`num_spec_tokens` speculative tokens proposed and verified in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class PrefillChunk:
    """Feed the next `num_tokens` not-yet-computed known tokens of a request."""

    request_id: str
    num_tokens: int

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"prefill num_tokens must be >= 1, got {self.num_tokens}")


@dataclass(frozen=True)
class DecodeStep:
    """Generate one token; with num_spec_tokens = k > 0, propose k and verify them too."""

    request_id: str
    num_spec_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")


PlanEntry = PrefillChunk | DecodeStep


@dataclass(frozen=True)
class BatchPlan:
    """One engine step. Each request appears at most once."""

    entries: tuple[PlanEntry, ...]
    preempt: tuple[str, ...] = ()
    """Requests whose KV is dropped before the step (tokens kept; resumed by a prefill)."""

    def __post_init__(self) -> None:
        ids = [e.request_id for e in self.entries]
        if len(ids) != len(set(ids)):
            raise ValueError("a request appears more than once in the batch plan")
        if set(ids) & set(self.preempt):
            raise ValueError("a request is both preempted and scheduled in the same plan")

    @property
    def num_tokens(self) -> int:
        """Target-model query tokens of the step (prefill chunk or k + 1 per decode)."""
        return sum(
            e.num_tokens if isinstance(e, PrefillChunk) else e.num_spec_tokens + 1
            for e in self.entries
        )


class FinishReason(StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass(frozen=True)
class TokenLogprob:
    """A produced token's log-probability under the target model, from its raw logits (before
    temperature, top-k and top-p, as vLLM reports by default), with the `k` most likely
    tokens and theirs when the request asked for them."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    """1 + how many tokens were likelier (vLLM's rank); reported for prompt tokens."""


@dataclass
class RequestOutcome:
    """What one step did to one request."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Known tokens now in the KV cache after the step."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: FinishReason | None = None
    abort_reason: str = ""
    """Why the replica ended the request as aborted (FinishReason.ABORT), for its client."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per new token, when the request's `logprobs` asks for them."""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """With the request's first token, when its `prompt_logprobs` asks for them: one per
    prompt token after the first."""
    num_judged_drafts: int | None = None
    """Drafts the verify judged, where a chain's count (`planner.budget.judged_drafts`) does
    not hold: a token tree's, one per node the walk accepted and the refusal where it stopped
    when that node had children (its unvisited branches were never judged)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BatchOutcome:
    """What a step did, and how long its parts took (seconds, measured)."""

    outcomes: list[RequestOutcome]
    draft_s: float = 0.0
    target_s: float = 0.0
    overhead_s: float = 0.0
    free_blocks: int = 0
    draft_steps: int | None = None
    """Draft forwards the step ran, and the requests they drafted for (`draft_batch`), where
    the verified drafts do not say (AdaServe's tree levels); None: they do."""
    draft_batch: int | None = None

    @property
    def total_s(self) -> float:
        return self.draft_s + self.target_s + self.overhead_s
