"""`slos-serve bench adaserve`: AdaServe's token trees against chains on the real engine.

All in one process and one run, on the demo pair, the same prompts and thread count: for each
batch and k (drafts planned per decode), greedy decoding with the planned chains and with
AdaServe's trees (the step's k x batch drafts spread as tree nodes, replica.planner.adaserve),
and at the largest batch sampling at temperature 1 (trees whose tokens the draft draws),
interleaved repeat by repeat so both see the same machine: decode tokens/s, tokens per verify
(accepted + 1), drafts verified per decode, and the trees' ratio. The requests are best effort,
so the trees' nodes go where the calibrated chance of acceptance is highest (the step's SLO
split is tested in tests/replica/test_spec.py). One AdaServe policy serves every repeat of a
(batch, k), as a replica's does, so its calibration carries over; each case reports the
share of each sibling rank's judged nodes the target accepted. Apart from the trees, at every
position of the prompts (teacher forced) the bench counts how often the target's top token is
the draft's first, second, ... choice (`rank_agreement`), and from it the sibling acceptance
`slos-serve simulate --sibling-acceptance` models. Prompts are windows of Python
standard-library source, the demo pair's own domain.
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
)
from replica.engine import Engine
from replica.kv_cache import KVCacheManager
from replica.model_runner import ForwardSeq, ModelRunner
from replica.planner.adaserve import AdaServeConfig, AdaServeTrees


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_arguments(parser)


def rank_agreement(
    target: ModelRunner, draft: ModelRunner, prompts: list[list[int]], ranks: int
) -> list[float]:
    """At every position of the prompts (held-out text, teacher forced), the share where the
    target's top token is the draft's rank-r choice, r < `ranks`: the chances a tree's
    children have, unbiased by which nodes a selection kept."""
    hits = [0] * ranks
    positions = 0
    for prompt in prompts:
        choices = []
        for runner in (target, draft):
            cache = KVCacheManager(runner.num_blocks)
            cache.append("agree", len(prompt))
            seq = ForwardSeq(prompt, cache.block_table("agree"), 0, num_logits=len(prompt))
            logits = runner.forward([seq])
            columns = logits.topk(ranks if runner is draft else 1).indices
            choices.append(runner.token_ids(columns).tolist())
            cache.free("agree")
        for (top,), drafted in zip(*choices, strict=True):
            positions += 1
            if top in drafted:
                hits[drafted.index(top)] += 1
    return [h / positions for h in hits]


def sibling_acceptance(agreement: list[float]) -> list[float]:
    """`rank_agreement` as `slos-serve simulate --sibling-acceptance` takes it: the chance the
    target takes the draft's rank-r choice (r >= 1) given it takes none of the ranks before."""
    left, out = 1.0 - agreement[0], []
    for share in agreement[1:]:
        out.append(share / left if left > 0 else 0.0)
        left -= share
    return out


def run(args: argparse.Namespace) -> int:
    bench = policy_bench(args, spare_per_request=4 * 6)
    target, draft, new_tokens = bench.target, bench.draft, bench.new_tokens
    cases = [(batch, k, 0.0) for batch in bench.batches for k in bench.ks]
    cases += [(max(bench.batches), k, 1.0) for k in bench.ks]
    agreement = rank_agreement(target, draft, bench.prompts, AdaServeConfig().max_width)
    bar = tqdm(total=len(cases) * args.repeats, desc="bench adaserve")
    rows = []
    for batch, k, temperature in cases:
        trees = AdaServeTrees(bench.perf)
        engines = {
            "chains": functools.partial(Engine, target, draft, proposer="draft"),
            "trees": functools.partial(Engine, target, draft, proposer="draft", adaserve=trees),
        }
        sampling = {"temperature": temperature} if temperature else None
        best = best_interleaved(
            engines, bench.prompts, batch, k, new_tokens, args.repeats, bar, sampling
        )
        rows.append(
            {
                "batch": batch,
                "k": k,
                "temperature": temperature,
                **best,
                "trees_over_chains": best["trees"]["tok_s"] / best["chains"]["tok_s"],
                "accepted_len_ratio": best["trees"]["mean_accepted_len"]
                / best["chains"]["mean_accepted_len"],
                "learned_chances": {
                    f"rank{r}": c.table() for r, c in enumerate(trees.calibration.ranks)
                },
                "rank_acceptance": trees.calibration.rank_acceptance(),
                "rank_judged": trees.calibration.judged,
                "draw_acceptance": trees.sampled.chances(AdaServeConfig().max_width),
            }
        )
    bar.close()
    results: dict[str, Any] = {"speed": rows}
    results["config"] = policy_config(args, len(bench.prompts), new_tokens)
    key = "b{batch}_k{k}_t{temperature:g}"
    results["summary"] = {
        "trees_over_chains": {key.format(**r): r["trees_over_chains"] for r in rows},
        "accepted_len_ratio": {key.format(**r): r["accepted_len_ratio"] for r in rows},
        "trees_over_chains_geomean": statistics.geometric_mean(
            [r["trees_over_chains"] for r in rows]
        ),
        "rank_agreement": agreement,
        "sibling_acceptance": sibling_acceptance(agreement),
    }
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0
