"""The simulated draft model's acceptance: what a verify of k drafts keeps.

Each drafted token is accepted with probability `alpha` until the first rejection (the i.i.d.
model behind E(s) = (1 - a^(s+1)) / (1 - a), the planner's budget formula). With a `spread`,
each request has its own alpha, drawn uniformly within `spread` of it: a draft model predicts
some texts far better than others. Every request draws from its own generator seeded by
(seed, request id), so the outcome of a request's verifies does not depend on how the cluster
interleaved it with other requests, and a run is reproducible for a seed.
"""

from __future__ import annotations

import random

from replica.planner.config import check_fraction

DEFAULT_ACCEPTANCE = 0.6
"""Per-token acceptance assumed for OPT-125m drafting for OPT-7B: an assumption (the seed
papers give no measured figure for this pair), equal to the planner's prior
(`SpecConfig.initial_acceptance`), so planner and engine start from the same value."""


class SeededAcceptance:
    """`PerfExecutor`'s accept hook: accepted drafts of one verify, per-request streams."""

    def __init__(self, alpha: float, seed: int, spread: float = 0.0) -> None:
        check_fraction("acceptance", alpha, low=0.0, high=1.0)
        check_fraction("acceptance_spread", spread, low=0.0, high=1.0)
        self.alpha = float(alpha)
        self.spread = float(spread)
        self.seed = seed
        self._streams: dict[str, tuple[random.Random, float]] = {}

    def __call__(self, request_id: str, drafted: int) -> int:
        rng, alpha = self._stream(request_id)
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        return accepted

    def alpha_of(self, request_id: str) -> float:
        """The request's own acceptance."""
        return self._stream(request_id)[1]

    def _stream(self, request_id: str) -> tuple[random.Random, float]:
        stream = self._streams.get(request_id)
        if stream is None:
            rng = random.Random(f"{self.seed}:{request_id}")
            alpha = self.alpha
            if self.spread > 0:
                alpha = min(1.0, max(0.0, alpha + self.spread * (2 * rng.random() - 1)))
            stream = self._streams[request_id] = (rng, alpha)
        return stream

    def forget(self, request_id: str) -> None:
        """Drop a finished request's stream (a long run keeps only live ones)."""
        self._streams.pop(request_id, None)
