"""The cluster demo: two replicas of the demo pair serve concurrent requests in two SLO tiers
through the Python API, and it prints what the cluster decided and how fast tokens came."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from cluster.api import FinalRecord, TokenChunk
from cluster.config import ClusterConfig, TierConfig
from cluster.handle import ClusterHandle, launch
from replica.request import SLO, Request, SamplingParams

PROMPTS = (
    "def fibonacci(n):\n",
    "def is_prime(n):\n    ",
    "import json\n\n\ndef load_config(path):\n    ",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "for i in range(10):\n    ",
    "def read_lines(path):\n    with open(path) as f:\n",
)
DEFAULT_TIERS = (
    TierConfig("interactive", ttft_ms=2000, tpot_ms=250),
    TierConfig("batch", ttft_ms=8000, tpot_ms=1000),
)


@dataclass(frozen=True)
class DemoResult:
    tier: str
    text: str
    record: FinalRecord


async def _serve(
    handle: ClusterHandle, tokenizer: Tokenizer, prompt: str, tier: TierConfig, index: int
) -> DemoResult:
    request = Request(
        f"demo-{index}",
        tokenizer.encode(prompt).ids,
        SamplingParams(max_tokens=32),
        slo=SLO(ttft_ms=tier.ttft_ms, tpot_ms=tier.tpot_ms),
        model=handle.model_name,
    )
    tokens: list[int] = []
    async for item in handle.submit(request):
        if isinstance(item, TokenChunk):
            tokens.extend(item.token_ids)
        else:
            return DemoResult(tier.name, prompt + tokenizer.decode(tokens), item)
    raise RuntimeError(f"stream of {request.request_id} ended without a final record")


def _line(result: DemoResult) -> str:
    r = result.record
    ttft = (
        "-"
        if r.first_token_time is None
        else f"{(r.first_token_time - r.arrival_time) * 1e3:.0f} ms"
    )
    span = (r.finish_time or r.arrival_time) - (r.first_token_time or r.arrival_time)
    rate = f"{(r.num_output_tokens - 1) / span:.1f} tok/s" if span > 0 else "-"
    slo = {True: "met", False: "missed", None: "-"}[r.slo_attained]
    return (
        f"{r.request_id:8} {result.tier:12} {r.verdict!s:12} replica={r.replica} hops={r.hops} "
        f"ttft={ttft:>8} tokens={r.num_output_tokens:3} {rate:>12} slo={slo}"
    )


async def _run(config: ClusterConfig, prompts: tuple[str, ...]) -> list[DemoResult]:
    tokenizer = Tokenizer.from_file(str(Path(config.model) / "tokenizer.json"))
    tiers = config.tiers or DEFAULT_TIERS
    started = time.perf_counter()
    handle = await launch(config)
    print(f"cluster up: {config.replicas} replicas in {time.perf_counter() - started:.1f} s")
    try:
        results = await asyncio.gather(
            *(
                _serve(handle, tokenizer, prompt, tiers[i % len(tiers)], i)
                for i, prompt in enumerate(prompts)
            )
        )
        for result in results:
            print(_line(result))
        for result in results:
            print(f"--- {result.record.request_id} ({result.tier})\n{result.text}")
        print(f"controller counters: {(await handle.status()).counters}")
        return list(results)
    finally:
        await handle.shutdown()


def run_demo(config: ClusterConfig, prompts: tuple[str, ...] = PROMPTS) -> list[DemoResult]:
    """Launch `config` (on a local Ray instance unless one is up), serve `prompts`, shut down."""
    return asyncio.run(_run(config, prompts))
