"""How much KV memory to reserve for an admitted request whose output length is unknown.

Reserving prompt + max_tokens makes admission memory-bound long before the GPU is busy when
outputs end far below their cap (ChatBot: mean 264 of 839). Instead a request reserves its
prompt plus a high quantile of the output lengths this replica has seen for the same
max_tokens, and extends by another quantile's worth when its tokens approach the reservation.
The first step is capped at `chunk_tokens`, every extension at the smaller `extension_tokens`,
so a long output's memory grows with it. A new request's larger first step is the margin
admission keeps for everyone's growth; the small extensions stop long-running requests from
holding memory they will not use before their next extension (see OutputEstimateConfig).
Until `min_samples` requests with that cap have finished, `prior_tokens` stands in for the
quantile. When extensions outgrow the cache, the newest admitted requests first give up the
headroom beyond their next step, and only then lose their guarantee (SlosScheduler demotes them
to best-effort), as vLLM preempts its newest requests.
Only finished outputs are observed, never a request's true length in advance.
"""

from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from replica.planner.config import OutputEstimateConfig
from replica.planner.queues import peak_tokens
from replica.request import Request


class OutputLengthEstimate:
    """Per max_tokens value: the last `window` finished output lengths."""

    def __init__(self, config: OutputEstimateConfig) -> None:
        self.config = config
        self._seen: dict[int, deque[int]] = {}
        self._quantiles: dict[int, int] = {}
        self._sorted: dict[int, tuple[list[int], list[int]]] = {}
        """Per cap: the seen lengths sorted, and their suffix sums (`expected_remaining`)."""

    def observe(self, request: Request, output_len: int) -> None:
        cap = request.sampling.max_tokens
        seen = self._seen.setdefault(cap, deque(maxlen=self.config.window))
        seen.append(output_len)
        self._quantiles.pop(cap, None)
        self._sorted.pop(cap, None)

    def expected_output(self, request: Request) -> int:
        """The output length to reserve for (at most max_tokens)."""
        cap = request.sampling.max_tokens
        seen = self._seen.get(cap)
        if seen is None or len(seen) < self.config.min_samples:
            return min(cap, self.config.prior_tokens)
        quantile = self._quantiles.get(cap)
        if quantile is None:
            value = float(np.quantile(np.fromiter(seen, dtype=float), self.config.quantile))
            quantile = self._quantiles[cap] = min(cap, max(1, int(np.ceil(value))))
        return quantile

    def expected_remaining(self, request: Request, produced: int) -> int:
        """Mean output tokens still to come after `produced`, over the finished outputs (of
        the same max_tokens) that were longer: what is left of a request whose own length is
        unknown. Until enough finished, up to `prior_tokens` (while short of it); with none
        longer, up to max_tokens."""
        cap = request.sampling.max_tokens
        seen = self._seen.get(cap)
        if seen is None or len(seen) < self.config.min_samples:
            prior = min(cap, self.config.prior_tokens)
            return max(1, (prior if produced < prior else cap) - produced)
        ordered = self._sorted.get(cap)
        if ordered is None:
            lengths = sorted(seen)
            suffix = [0] * (len(lengths) + 1)
            for i in range(len(lengths) - 1, -1, -1):
                suffix[i] = suffix[i + 1] + lengths[i]
            ordered = self._sorted[cap] = (lengths, suffix)
        lengths, suffix = ordered
        first = bisect.bisect_right(lengths, produced)
        longer = len(lengths) - first
        if not longer:
            return max(1, cap - produced)
        return max(1, round(suffix[first] / longer) - produced)

    def initial_tokens(self, request: Request) -> int:
        """KV slots to reserve at admission: the prompt plus the expected output."""
        first = self._step(request, self.config.chunk_tokens)
        return min(peak_tokens(request), request.prompt_len + first - 1)

    def extended_tokens(self, request: Request, reserved: int) -> int:
        """The next reservation once `reserved` slots are nearly used."""
        return min(
            peak_tokens(request), reserved + self._step(request, self.config.extension_tokens)
        )

    def _step(self, request: Request, cap: int) -> int:
        return min(self.expected_output(request), cap)
