"""`slos-serve bench prefix`: what prefix caching saves when requests share a long prefix (a
system prompt, the history of a chat), on the real engine.

One process, one run, the demo pair with draft speculation (k = 3, the cluster's default
drafter): the same requests, each a shared prefix of Python standard-library source followed
by a tail of its own, served one after another by an engine without the cache and by one
with it, interleaved repeat by repeat so both see the same machine. Per engine: prompt tokens
the target computed, time to first token (the prefill step) of the first request (nothing
cached yet) and of the rest (median), decode tokens/s, and whether the outputs are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from loadgen.bench_engine import (
    DTYPES,
    add_pair_arguments,
    draft_runner,
    kv_blocks_for,
    stdlib_prompts,
)
from replica.arguments import check_model_folders, positive_int
from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier

K = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument("--requests", type=positive_int, default=12)
    parser.add_argument("--shared-tokens", type=positive_int, default=448)
    parser.add_argument("--tail-tokens", type=positive_int, default=32)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")


def serve_one_by_one(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Each request alone, prefilled in one chunk (after its cached prefix), then decoded."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ttfts, outputs = [], []
    computed = decoded = 0
    decode_s = 0.0
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        engine.add_request(Request(rid, prompt, params, tier=Tier.BEST_EFFORT))
        start = time.perf_counter()
        cached = engine.attach_prefix(rid)
        engine.step(BatchPlan((PrefillChunk(rid, len(prompt) - cached),)))
        ttfts.append(time.perf_counter() - start)
        computed += len(prompt) - cached
        start = time.perf_counter()
        while engine.finish_reason(rid) is None:
            engine.step(BatchPlan((DecodeStep(rid, K),)))
        decode_s += time.perf_counter() - start
        outputs.append(engine.output_token_ids(rid))
        decoded += len(outputs[-1]) - 1
        engine.abort(rid)
    return {
        "prompt_tokens_computed": computed,
        "first_ttft_s": ttfts[0],
        "median_ttft_s": statistics.median(ttfts[1:]),
        "decode_tok_s": decoded / decode_s,
        "outputs": outputs,
    }


def run(args: argparse.Namespace) -> int:
    check_model_folders(("--target", args.target), ("--draft", args.draft))
    torch.set_num_threads(args.threads)
    requests, shared, tail, new_tokens = (
        (3, 64, 16, 4)
        if args.quick
        else (args.requests, args.shared_tokens, args.tail_tokens, args.new_tokens)
    )
    if requests < 2:
        raise SystemExit("--requests must be >= 2: the first fills the cache, the rest hit it")
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    windows = stdlib_prompts(lambda text: tokenizer.encode(text).ids, requests + 1, shared + tail)
    prefix = windows[0][:shared]
    prompts = [prefix + w[:tail] for w in windows[1:]]
    num_blocks = kv_blocks_for(requests, shared + tail + new_tokens)
    target = ModelRunner(args.target, num_blocks=num_blocks, dtype=DTYPES[args.dtype])
    draft = draft_runner(target, args.draft)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in tqdm(range(args.repeats), desc="bench prefix"):
        for name in runs:
            engine = Engine(target, draft, proposer="draft", prefix_caching=name == "on")
            runs[name].append(serve_one_by_one(engine, prompts, new_tokens))
    same = all(  # every repeat's outputs compared (and dropped from the JSON)
        [off.pop("outputs") == on.pop("outputs") for off, on in zip(*runs.values(), strict=True)]
    )
    best = {name: min(r, key=lambda row: row["median_ttft_s"]) for name, r in runs.items()}
    results: dict[str, Any] = {
        "off": best["off"],
        "on": best["on"],
        "summary": {
            "same_outputs": same,
            "prompt_tokens_computed_ratio": best["on"]["prompt_tokens_computed"]
            / best["off"]["prompt_tokens_computed"],
            "median_ttft_speedup": best["off"]["median_ttft_s"] / best["on"]["median_ttft_s"],
            "decode_tok_s_ratio": best["on"]["decode_tok_s"] / best["off"]["decode_tok_s"],
        },
        "runs": runs,
        "config": {
            "target": str(args.target),
            "draft": str(args.draft),
            "requests": requests,
            "shared_tokens": shared,
            "tail_tokens": tail,
            "new_tokens": new_tokens,
            "k": K,
            "dtype": args.dtype,
            "threads": args.threads,
            "repeats": args.repeats,
            "quick": args.quick,
            "torch": torch.__version__,
        },
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0 if same else 1
