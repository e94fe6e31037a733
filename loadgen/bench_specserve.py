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
import functools
import json
import statistics
from typing import Any

from tqdm import tqdm

from loadgen.bench_engine import (
    add_policy_arguments,
    best_interleaved,
    policy_bench,
    policy_config,
    spec_run,
)
from replica.engine import Engine
from replica.model_runner import ModelRunner
from replica.perf_model import PerfModel
from replica.planner.specserve import ConfidenceCalibration, SpecServeLengths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_arguments(parser)


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


def _specserve_engine(
    target: ModelRunner, draft: ModelRunner, perf: PerfModel, made: list[SpecServeLengths]
) -> Engine:
    """A SpecServe engine learning from scratch; `made` keeps its lengths to read after."""
    made.append(SpecServeLengths(perf))
    return Engine(target, draft, proposer="draft", specserve=made[-1])


def run(args: argparse.Namespace) -> int:
    bench = policy_bench(args)
    target, draft, prompts, new_tokens = bench.target, bench.draft, bench.prompts, bench.new_tokens
    batches, ks, perf = bench.batches, bench.ks, bench.perf
    bar = tqdm(total=1 + len(batches) * len(ks) * args.repeats, desc="bench specserve")
    results: dict[str, Any] = {
        "calibration": calibration(target, draft, prompts, max(ks) + 2, new_tokens)
    }
    bar.update()
    rows = []
    learned: list[float] = []
    for batch in batches:
        for k in ks:
            made: list[SpecServeLengths] = []
            engines = {
                "slos": functools.partial(Engine, target, draft, proposer="draft"),
                "specserve": functools.partial(_specserve_engine, target, draft, perf, made),
            }
            best = best_interleaved(engines, prompts, batch, k, new_tokens, args.repeats, bar)
            learned = made[-1].greedy.table()
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
    results["config"] = policy_config(args, len(prompts), new_tokens)
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
