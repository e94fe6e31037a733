"""The simulated draft model's acceptance: what a verify of k drafts keeps.

Each drafted token is accepted with probability `alpha` until the first rejection (the i.i.d.
model behind E(s) = (1 - a^(s+1)) / (1 - a), the planner's budget formula). Every request
draws from its own generator seeded by (seed, request id), so the outcome of a request's
verifies does not depend on how the cluster interleaved it with other requests, and a run is
reproducible for a seed.
"""

from __future__ import annotations

import math
import random

DEFAULT_ACCEPTANCE = 0.6
"""Per-token acceptance assumed for OPT-125m drafting for OPT-7B: an assumption (the seed
papers give no measured figure for this pair), equal to the planner's prior
(`SpecConfig.initial_acceptance`), so planner and engine start from the same value."""


class SeededAcceptance:
    """`PerfExecutor`'s accept hook: accepted drafts of one verify, per-request streams."""

    def __init__(self, alpha: float, seed: int) -> None:
        number = isinstance(alpha, int | float) and not isinstance(alpha, bool)
        if not number or not math.isfinite(alpha):
            raise ValueError(f"acceptance must be a finite number, got {alpha!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.seed = seed
        self._streams: dict[str, random.Random] = {}

    def __call__(self, request_id: str, drafted: int) -> int:
        rng = self._streams.get(request_id)
        if rng is None:
            rng = self._streams[request_id] = random.Random(f"{self.seed}:{request_id}")
        accepted = 0
        while accepted < drafted and rng.random() < self.alpha:
            accepted += 1
        return accepted

    def forget(self, request_id: str) -> None:
        """Drop a finished request's stream (a long run keeps only live ones)."""
        self._streams.pop(request_id, None)
