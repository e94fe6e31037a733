"""Zero-load latency of a live server, measured: the base the SLOs of a real run scale from.

A perf profile predicts a replica's step times on an idle core; a request through a live
server also pays the front door, Ray hops and up to one planning tick before its first token.
The paper states TTFT SLOs as slowdowns over the zero-load TTFT, so a real run can measure it:
send single requests one at a time (no load) at a few prompt lengths, fit TTFT = base +
per_token x prompt length, and take the median time per output token as the decode step.

The result is saved with a run's JSON (`zero_load`), so runs against other servers (baseline
policies) reuse the same numbers and are held to the same SLOs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.clients import LoadClient
from loadgen.metrics import mean_tpot_s, ttft_s
from loadgen.prompts import Prompts
from loadgen.workloads import WorkloadRequest
from replica.request import SLO

PROBE_PROMPT_LENS = (100, 800, 2000)
"""Probe prompt lengths before --length-scale: Table 4's prompts run from ~100 to ~2000 tokens."""
PROBE_OUTPUT_LEN = 16
PROBE_REPEATS = 3
PROBE_SLO = SLO(ttft_ms=60_000.0, tpot_ms=10_000.0)
"""Loose enough that every policy admits the probes."""


@dataclass(frozen=True)
class ZeroLoad:
    ttft_base_s: float
    ttft_per_token_s: float
    decode_step_s: float
    """Median seconds per output token after the first, on an idle server."""
    source: str

    def __post_init__(self) -> None:
        for name in ("ttft_base_s", "ttft_per_token_s", "decode_step_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"zero_load.{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"zero_load.{name} must be finite and >= 0, got {value!r}")
        if self.decode_step_s <= 0:
            raise ValueError(f"zero_load.decode_step_s must be > 0, got {self.decode_step_s}")
        if self.ttft_base_s + self.ttft_per_token_s <= 0:
            raise ValueError("zero_load TTFT must be > 0 for a 1-token prompt")

    def ttft_s(self, prompt_len: int) -> float:
        return self.ttft_base_s + self.ttft_per_token_s * prompt_len

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def load(cls, path: Path) -> ZeroLoad:
        """From a loadgen --json output (its `zero_load`) or a file holding just that object."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read zero-load numbers from {str(path)!r}: {exc}") from None
        block = data.get("zero_load", data) if isinstance(data, dict) else None
        keys = ("ttft_base_s", "ttft_per_token_s", "decode_step_s")
        if not isinstance(block, dict) or any(k not in block for k in keys):
            raise ValueError(f"{str(path)!r} holds no zero_load object with {list(keys)}")
        source = str(block.get("source", path))
        return cls(block["ttft_base_s"], block["ttft_per_token_s"], block["decode_step_s"], source)


def fit_zero_load(
    prompt_lens: Sequence[int], ttfts_s: Sequence[float], tpots_s: Sequence[float], source: str
) -> ZeroLoad:
    """Least-squares line through (prompt length, TTFT), slope >= 0; median TPOT."""
    if len(prompt_lens) != len(ttfts_s) or not ttfts_s or not tpots_s:
        raise ValueError("need one TTFT per prompt length and at least one TPOT")
    x = np.asarray(prompt_lens, dtype=float)
    y = np.asarray(ttfts_s, dtype=float)
    slope = float(np.polyfit(x, y, 1)[0]) if len(set(prompt_lens)) > 1 else 0.0
    slope = max(0.0, slope)
    base = max(0.0, float(np.mean(y - slope * x)))
    return ZeroLoad(base, slope, float(np.median(tpots_s)), source)


async def probe(
    client: LoadClient,
    source: Prompts,
    prompt_lens: Sequence[int],
    label: str,
    repeats: int = PROBE_REPEATS,
    output_len: int = PROBE_OUTPUT_LEN,
) -> ZeroLoad:
    """Send probe requests one at a time and fit the zero-load numbers."""
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    for i, n in enumerate(p for p in prompt_lens for _ in range(repeats)):
        request = WorkloadRequest(
            request_id=f"zero-load-{i}",
            scenario="probe",
            slo_class="probe",
            arrival_s=0.0,
            prompt_len=n,
            output_len=output_len,
            max_tokens=output_len,
            slo=PROBE_SLO,
            zero_load_ttft_s=1.0,
        )
        record = (await client.send(request, source.prompt(n), clock)).record
        ttft, tpot = ttft_s(record), mean_tpot_s(record)
        if not record.complete or ttft is None or tpot is None:
            reason = record.error or f"{record.delivered} of {output_len} tokens"
            raise ValueError(f"zero-load probe {request.request_id} ({n} tokens) failed: {reason}")
        lens.append(n)
        ttfts.append(ttft)
        tpots.append(tpot)
    return fit_zero_load(lens, ttfts, tpots, label)
