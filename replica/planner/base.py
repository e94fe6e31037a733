"""The scheduler interface every local policy implements (vllm, sarathi, slos).

A scheduler is pure: no torch, no ray, no wall clock. It sees requests as token counts, turns
them into `BatchPlan`s and learns what happened from `BatchOutcome`s, so the same object runs
next to a real engine, inside the controller's virtual replica, and in the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

from mypy_extensions import mypyc_attr

from replica.batch import BatchOutcome, BatchPlan
from replica.compiled import reduce_frozen
from replica.request import Request


def leading_tokens(prompt: list[int], output: list[int], upto: int) -> list[int]:
    """The first `upto` tokens of a request's prompt, then its output (the prompt alone is
    not copied whole when it covers them)."""
    if upto <= len(prompt):
        return prompt[:upto]
    return [*prompt, *output[: upto - len(prompt)]]


@dataclass(frozen=True)
class CacheBudget:
    """The replica's KV capacity as the scheduler must respect it."""

    num_blocks: int
    block_size: int = 16

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass
class RequestState:
    """A scheduler's view of one request: known tokens and how many are in the KV cache."""

    request: Request
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    first_token_time: float | None = None
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_known_tokens(self) -> int:
        return self.request.prompt_len + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens still to be fed (prompt chunks, or resume after preemption)."""
        return self.num_known_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """All known tokens but the last are cached: the next step samples a new token."""
        return self.num_uncomputed <= 1 and bool(self.output_token_ids)

    @property
    def remaining_output(self) -> int:
        return self.request.sampling.max_tokens - len(self.output_token_ids)

    def apply(
        self, outcome_tokens: list[int], num_computed: int, finished: bool, now: float
    ) -> None:
        if outcome_tokens and self.first_token_time is None:
            self.first_token_time = now
        seen = len(self.output_token_ids)
        self.output_token_ids.extend(outcome_tokens)
        slo = self.request.slo
        if slo is not None and slo.stages:  # most have none
            closed = slo.closed_by(self.output_token_ids, seen)
            if closed is not slo:  # a copy of its own: the caller's request keeps its SLO
                self.request = replace(self.request, slo=closed)
        self.num_computed_tokens = num_computed
        self.finished = self.finished or finished


@mypyc_attr(allow_interpreted_subclasses=True)
class Scheduler(ABC):
    """Invariants: every plan fits the `CacheBudget`; a request is in at most one entry per
    plan; `update_from_outcome` is called once per executed plan, in order."""

    @abstractmethod
    def add_request(self, request: Request, now: float, cached: int = 0) -> None:
        """Queue a new request (already validated) that starts from `cached` leading prompt
        tokens the replica's prefix cache holds (RequestQueues.add)."""

    @abstractmethod
    def abort_request(self, request_id: str) -> None:
        """Forget a request (client gone); its blocks count as free from the next plan."""

    @abstractmethod
    def schedule(self, now: float) -> BatchPlan | None:
        """The next step to run, or None when there is nothing to do."""

    @abstractmethod
    def update_from_outcome(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        """Fold the engine's report of `plan` into the scheduler's state."""

    def restore(self, plan: BatchPlan, outcome: BatchOutcome, now: float) -> None:
        """Take in what the replica did before this scheduler saw it (a mirror rebuilt from
        the replica's snapshot), replayed as one step."""
        self.update_from_outcome(plan, outcome, now)

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
