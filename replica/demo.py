"""`slos-serve demo`: a few Python prompts served concurrently by one local replica.

It shows the data plane end to end on the shipped demo pair: tokenizer, scheduler (the
SLOs-Serve planner by default, or the vllm / sarathi baselines), engine (with the draft model
speculating when --spec-k > 0) and the per-request streams, then prints each continuation with
its time to first token, its admission verdict, and the aggregate output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from replica.arguments import (
    OptionError,
    check_model_folders,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from replica.engine import Engine
from replica.local import LocalReplica, TokenChunk, cache_budget
from replica.planner.base import CacheBudget, Scheduler
from replica.planner.config import PlannerConfig, SpecConfig
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.slos import SlosScheduler
from replica.planner.vllm import VllmConfig, VllmScheduler
from replica.profiles import CPU_PROFILE, DEPLOY, load_profile
from replica.request import SLO, Request, SamplingParams

MODELS = DEPLOY / "models"
PROMPTS = (
    "def fibonacci(n):\n",
    "def is_prime(n):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import json\n\n\ndef load_config(path):\n    ",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "for i in range(10):\n    ",
    "def read_lines(path):\n    with open(path) as f:\n",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", type=Path, default=MODELS / "demo-target", help="target model folder (HF)"
    )
    parser.add_argument(
        "--draft", type=Path, default=MODELS / "demo-draft", help="draft model folder (HF)"
    )
    parser.add_argument(
        "--scheduler",
        choices=("slos", "vllm", "sarathi"),
        default="slos",
        help="SLOs-Serve planner (slos), prefill-first (vllm) or decode-first chunked (sarathi)",
    )
    parser.add_argument(
        "--profile",
        default=CPU_PROFILE,
        help="perf-model profile the slos planner plans with: a name in deploy/profiles, a "
        "deploy config's short name or a path (default %(default)s)",
    )
    parser.add_argument(
        "--ttft-ms", type=positive_float, default=2000.0, help="SLO: time to first token"
    )
    parser.add_argument(
        "--tpot-ms", type=positive_float, default=200.0, help="SLO: time per output token"
    )
    parser.add_argument(
        "--spec-k",
        type=non_negative_int,
        default=3,
        help="draft tokens per decode (0: no speculation)",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=64, help="output tokens per request"
    )
    parser.add_argument("--prompts", type=positive_int, default=4, help="concurrent requests")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument(
        "--token-budget",
        type=positive_int,
        default=None,
        help="tokens per step (default: 256 for sarathi, the model context for vllm)",
    )
    parser.add_argument(
        "--num-blocks", type=positive_int, default=256, help="KV blocks of 16 tokens"
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads")


@dataclass
class Served:
    request: Request
    token_ids: list[int]
    last: TokenChunk


def make_scheduler(args: argparse.Namespace, budget: CacheBudget, max_model_len: int) -> Scheduler:
    if args.scheduler == "slos":
        spec = SpecConfig(max_spec_tokens=args.spec_k) if args.spec_k > 0 else None
        perf = load_profile("--profile", args.profile)
        if perf.tp != 1:
            raise OptionError(
                f"--profile is for tensor parallelism {perf.tp}; the demo runs one process"
            )
        return SlosScheduler(perf, budget, PlannerConfig(spec=spec))
    if args.scheduler == "vllm":
        tokens = args.token_budget or max_model_len
        return VllmScheduler(budget, VllmConfig(max_num_batched_tokens=tokens, spec_k=args.spec_k))
    tokens = args.token_budget or 256
    return SarathiScheduler(budget, SarathiConfig(token_budget=tokens, spec_k=args.spec_k))


async def serve(replica: LocalReplica, requests: list[Request]) -> list[Served]:
    async def one(request: Request) -> Served:
        tokens: list[int] = []
        async for chunk in replica.generate(request):
            tokens.extend(chunk.token_ids)
            if chunk.finished:
                return Served(request, tokens, chunk)
        raise RuntimeError(f"stream of {request.request_id} ended without a finish record")

    await replica.start()
    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await replica.stop()


def run(args: argparse.Namespace) -> int:
    draft = args.draft if args.spec_k > 0 else None
    check_model_folders(("--target", args.target), ("--draft", draft))
    torch.set_num_threads(args.threads)
    engine = Engine.from_dirs(args.target, draft, num_blocks=args.num_blocks)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        slo = SLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)
        requests = [
            Request(f"demo-{i}", tokenizer.encode(text).ids, params, slo=slo)
            for i, text in enumerate(texts)
        ]
        for request in requests:
            request.check_fits(engine.max_model_len, engine.target.vocab_size)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    scheduler = make_scheduler(args, cache_budget(engine), engine.max_model_len)
    replica = LocalReplica(engine, scheduler)
    start = time.perf_counter()
    served = asyncio.run(serve(replica, requests))
    elapsed = time.perf_counter() - start

    for s in served:
        timings = s.last.timings
        ttft = timings.ttft if timings is not None else None
        ttft_text = f"{ttft * 1e3:.0f} ms" if ttft is not None else "-"
        verdict = ""
        if isinstance(scheduler, SlosScheduler):
            admitted = scheduler.verdicts.get(s.request.request_id, False)
            verdict = ", admitted" if admitted else ", best-effort"
        print(
            f"=== {s.request.request_id}: ttft {ttft_text}, {len(s.token_ids)} tokens, "
            f"finish {s.last.finish_reason}{verdict}"
        )
        print(tokenizer.decode(s.request.prompt_token_ids + s.token_ids))
    total = sum(len(s.token_ids) for s in served)
    print(
        f"=== {len(served)} requests, {total} tokens in {elapsed:.2f} s: "
        f"{total / elapsed:.1f} tokens/s (scheduler {args.scheduler}, spec-k {args.spec_k})"
    )
    return 0
