"""`slos-serve bench specserve`: SpecServe's lengths on the real engine, and whether the demo
draft's confidences are calibrated, which SpecServe relies on.

All in one process and one run, on the demo pair, the same prompts and thread count:
- calibration: greedy decoding with k drafts per step; per bin of the draft's confidence (its
  softmax probability of the token), the drafts the target judged (those up to the first
  refusal) and the share it accepted. Calibrated confidences would be accepted at their own
  value (`calibration_error`: the judged-weighted distance from each bin's centre).
  `chance_concentration` is the Beta concentration, by moments (mean m, variance v:
  m (1 - m) / v - 1), of the judged drafts' calibrated chances (their bins' acceptance): how
  telling the draft's confidence is once calibrated, what `slos-serve simulate
  --draft-confidence` takes;
- speed: for each batch and k, the slos engine (every planned draft drafted and verified) and
  the SpecServe engine (the drafter's floor and the verifier's trim, priced by the perf
  profile the cluster plans with), interleaved repeat by repeat so both see the same machine:
  decode tokens/s, drafts verified per decode, their acceptance, and SpecServe's ratio.
Prompts are windows of Python standard-library source, the demo pair's own domain.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from cluster.controller import DEFAULT_PROFILE
from loadgen.bench_engine import (
    DTYPES,
    add_pair_arguments,
    draft_runner,
    kv_blocks_for,
    spec_run,
    stdlib_prompts,
)
from replica.engine import Engine
from replica.model_runner import ModelRunner
from replica.perf_model import PerfModel
from replica.planner.specserve import ConfidenceCalibration, SpecServeLengths

PROMPT_TOKENS = 224
"""Each prompt's length, bench engine's full-run context."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument(
        "--profile",
        type=Path,
        default=DEFAULT_PROFILE,
        help="perf profile SpecServe prices steps with (default: the shipped CPU profile)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")


def calibration(
    target: ModelRunner, draft: ModelRunner, prompts: list[list[int]], k: int, new_tokens: int
) -> dict[str, Any]:
    """Greedy decoding at k on an engine that keeps every draft (SpecServe pricing every step
    alike, so no draft is ever worth dropping) and counts, per confidence bin, the drafts the
    target judged and accepted."""
    counts = ConfidenceCalibration(prior_weight=1e-9, window=2**62)
    free = PerfModel.synthetic({"const": 1.0}, {"tokens": 1e-9}, note="every step alike")
    engine = Engine(
        target, draft, proposer="draft", specserve=SpecServeLengths(free, greedy=counts)
    )
    spec_run(engine, prompts, len(prompts), k, new_tokens)
    bins: list[dict[str, Any]] = []
    judged_total = mean = 0.0
    for b, (judged, accepted) in enumerate(zip(counts.judged, counts.accepted, strict=True)):
        if judged >= 1:
            low, high = b / counts.bins, (b + 1) / counts.bins
            bins.append(
                {
                    "confidence": [low, high],
                    "judged": round(judged),
                    "acceptance": accepted / judged,
                }
            )
            judged_total += judged
            mean += accepted
    mean /= judged_total
    variance = centre_error = 0.0
    for row in bins:
        variance += row["judged"] * (row["acceptance"] - mean) ** 2 / judged_total
        centre = (row["confidence"][0] + row["confidence"][1]) / 2
        centre_error += row["judged"] * abs(row["acceptance"] - centre) / judged_total
    return {
        "k": k,
        "judged_drafts": round(judged_total),
        "acceptance": mean,
        "calibration_error": centre_error,
        "chance_concentration": mean * (1 - mean) / variance - 1 if variance > 0 else None,
        "bins": bins,
    }


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    batches, ks, new_tokens, count = (
        ((1, 4), (4,), 8, 4) if args.quick else ((1, 8), (2, 4, 6), 64, 8)
    )
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    prompts = stdlib_prompts(lambda text: tokenizer.encode(text).ids, count, PROMPT_TOKENS)
    num_blocks = kv_blocks_for(count, PROMPT_TOKENS + new_tokens)
    target = ModelRunner(args.target, num_blocks=num_blocks, dtype=DTYPES[args.dtype])
    draft = draft_runner(target, args.draft)
    perf = PerfModel.load(args.profile)
    bar = tqdm(total=1 + len(batches) * len(ks) * args.repeats, desc="bench specserve")
    results: dict[str, Any] = {
        "calibration": calibration(target, draft, prompts, max(ks) + 2, new_tokens)
    }
    bar.update()
    rows = []
    learned: list[float] = []
    for batch in batches:
        for k in ks:
            runs: dict[str, list[dict[str, Any]]] = {"slos": [], "specserve": []}
            for _ in range(args.repeats):
                for name in runs:
                    specserve = SpecServeLengths(perf) if name == "specserve" else None
                    engine = Engine(target, draft, proposer="draft", specserve=specserve)
                    runs[name].append(spec_run(engine, prompts, batch, k, new_tokens))
                    if specserve is not None:
                        learned = specserve.greedy.table()
                bar.update()
            best = {name: max(r, key=lambda row: row["tok_s"]) for name, r in runs.items()}
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    **{name: row for name, row in best.items()},
                    "specserve_over_slos": best["specserve"]["tok_s"] / best["slos"]["tok_s"],
                }
            )
    bar.close()
    results["speed"] = rows
    results["learned_chances"] = learned
    results["config"] = {
        "target": str(args.target),
        "draft": str(args.draft),
        "profile": str(args.profile),
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "prompts": count,
        "new_tokens": new_tokens,
        "torch": torch.__version__,
    }
    ratios = [r["specserve_over_slos"] for r in rows]
    cal = results["calibration"]
    results["summary"] = {
        "calibration_error": cal["calibration_error"],
        "chance_concentration": cal["chance_concentration"],
        "specserve_over_slos": {f"b{r['batch']}_k{r['k']}": r["specserve_over_slos"] for r in rows},
        "specserve_over_slos_geomean": statistics.geometric_mean(ratios),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0
