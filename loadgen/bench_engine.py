"""`slos-serve bench engine`: engine vs transformers throughput, and speculative speedup.

All in one process and one run, on the same model, requests and thread count:
- decode throughput at batch 1, 8, 32 with ~256-token contexts, and prefill throughput, for our
  engine (each dtype asked for) and for transformers `generate` (fp32, equal-length batch, so
  no padding is needed), with the ratio;
- speculative decoding at batch 1 and 8 for k in {0, 2, 3, 4, 6}, for the draft-model and the
  n-gram proposer, over the same 8 prompts (batch 1 decodes them one after another): tokens/s,
  acceptance rate, mean tokens per verify step, speedup over k = 0, and where the step time
  goes (draft / target / overhead);
- what bias and penalties cost: the same speculation runs (k = 0, and the draft at k = 3) with
  and without frequency, presence and repetition penalties and a logit bias, side by side.
Prompts are windows of Python standard-library source, the demo pair's own domain.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sysconfig
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from replica.arguments import check_model_folders, output_file, positive_int
from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine, ProposerKind
from replica.model_runner import ModelRunner
from replica.perf_model import PerfModel
from replica.profiles import CPU_PROFILE, load_profile
from replica.request import Request, SamplingParams, Tier
from replica.spec.draft import load_draft_vocab

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHAPING = {
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": tuple((token, 1.0) for token in range(64)),
}
"""A request with every kind of logits shaping (replica.sampling.LogitsShaper)."""
STRUCTURED = {"grammar": llguidance.LLMatcher.grammar_from_regex(r"[\n\t -~]*")}
"""Structured output that printable text, the demo pair's usual output, follows: what a
token mask costs per sampled row, with an output that stays (nearly) the plain one."""
SHAPING_K = 3


@dataclass(frozen=True)
class Settings:
    context: int
    """Prompt tokens; decode then runs at contexts from here to context + new_tokens."""
    new_tokens: int
    batches: tuple[int, ...]
    spec_batches: tuple[int, ...]
    spec_ks: tuple[int, ...]
    spec_new_tokens: int
    spec_prompts: int
    """Prompts every speculation case decodes (batch 1 runs them one after another)."""

    @classmethod
    def for_run(cls, quick: bool) -> Settings:
        if quick:
            return cls(32, 4, (1, 2), (1,), (0, 2), 6, 2)
        return cls(224, 32, (1, 8, 32), (1, 8), (0, 2, 3, 4, 6), 64, 8)


def default_models_dir() -> Path:
    override = os.environ.get("SLOS_DEMO_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "deploy" / "models"


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """What every engine bench takes: the model pair, output, size and repeats."""
    models = default_models_dir()
    parser.add_argument("--target", type=Path, default=models / "demo-target")
    parser.add_argument("--draft", type=Path, default=models / "demo-draft")
    parser.add_argument("--json", type=output_file, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="runs per case; the best counts"
    )


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """What a bench of a speculation policy takes: the pair's, and the profile it prices
    steps with."""
    add_pair_arguments(parser)
    parser.add_argument(
        "--profile",
        default=CPU_PROFILE,
        help="perf profile the policy prices steps with: a name or a path (default %(default)s, "
        "the shipped CPU profile)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")


POLICY_PROMPT_TOKENS = 224
"""Each prompt's length in a policy bench, the engine bench's full-run context."""


@dataclass
class PolicyBench:
    """What a speculation policy's bench runs on: the cases, the prompts, the pair and the
    profile, loaded once."""

    batches: tuple[int, ...]
    ks: tuple[int, ...]
    new_tokens: int
    prompts: list[list[int]]
    target: ModelRunner
    draft: ModelRunner
    perf: PerfModel


def policy_bench(args: argparse.Namespace, spare_per_request: int = 0) -> PolicyBench:
    """Load a policy bench (`--quick`: one k, few tokens); each request's KV holds its prompt,
    its output and `spare_per_request` tokens more. A bad profile or a missing model is named
    before any model loads."""
    perf = load_profile("--profile", args.profile)
    check_model_folders(("--target", args.target), ("--draft", args.draft))
    torch.set_num_threads(args.threads)
    batches, ks, new_tokens, count = (
        ((1, 4), (4,), 8, 4) if args.quick else ((1, 8), (2, 4, 6), 64, 8)
    )
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    prompts = stdlib_prompts(lambda text: tokenizer.encode(text).ids, count, POLICY_PROMPT_TOKENS)
    context = POLICY_PROMPT_TOKENS + new_tokens + spare_per_request
    target = ModelRunner(
        args.target, num_blocks=kv_blocks_for(count, context), dtype=DTYPES[args.dtype]
    )
    draft = draft_runner(target, args.draft)
    return PolicyBench(batches, ks, new_tokens, prompts, target, draft, perf)


def best_interleaved(
    engines: Mapping[str, Callable[[], Engine]],
    prompts: list[list[int]],
    batch: int,
    k: int,
    new_tokens: int,
    repeats: int,
    bar: tqdm[Any],
    sampling: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each engine's fastest `spec_run` of `repeats`, the engines taking turns within every
    repeat so that all see the same machine (a fresh engine per run, from its factory);
    `sampling`: the requests' sampling parameters beyond greedy."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, make in engines.items():
            runs[name].append(spec_run(make(), prompts, batch, k, new_tokens, sampling))
        bar.update()
    return {name: max(r, key=lambda row: row["tok_s"]) for name, r in runs.items()}


def policy_config(args: argparse.Namespace, prompts: int, new_tokens: int) -> dict[str, Any]:
    """A policy bench's settings, as its JSON records them."""
    return {
        "target": str(args.target),
        "draft": str(args.draft),
        "profile": str(args.profile),
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "torch": torch.__version__,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_pair_arguments(parser)
    parser.add_argument(
        "--dtype",
        choices=[*DTYPES, "all"],
        default="all",
        help="engine dtype(s) for the throughput section; speculation uses the fastest",
    )


def stdlib_prompts(tokenize: Any, count: int, length: int) -> list[list[int]]:
    """`count` token windows of `length` from different standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 8000)
    prompts: list[list[int]] = []
    step = max(1, len(files) // max(count, 1))
    for path in files[::step]:
        ids = tokenize(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 2 * length:
            start = len(ids) // 3
            prompts.append(ids[start : start + length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"found only {len(prompts)} standard-library files of {2 * length} tokens")


def _requests(
    prompts: list[list[int]], max_tokens: int, tag: str, shaping: dict[str, Any] | None = None
) -> list[Request]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(shaping or {}))
    return [Request(f"{tag}-{i}", p, params, tier=Tier.BEST_EFFORT) for i, p in enumerate(prompts)]


def engine_throughput(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Prefill every prompt in one step, then `new_tokens` decode steps; both timed."""
    reqs = _requests(prompts, new_tokens + 1, f"tp{len(prompts)}")
    for r in reqs:
        engine.add_request(r)
    start = time.perf_counter()
    engine.step(BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in reqs)))
    prefill_s = time.perf_counter() - start
    plan = BatchPlan(tuple(DecodeStep(r.request_id) for r in reqs))
    start = time.perf_counter()
    for _ in range(new_tokens):
        engine.step(plan)
    decode_s = time.perf_counter() - start
    for r in reqs:
        engine.abort(r.request_id)
    return {
        "prefill_tok_s": sum(len(p) for p in prompts) / prefill_s,
        "decode_tok_s": len(prompts) * new_tokens / decode_s,
    }


def hf_throughput(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers `generate`, timed per token by a stopping criterion that only stamps the
    clock: prefill is the time to the first token, decode the time from there to the last.
    (Timing decode as a difference of two whole runs let prefill noise reach the decode rate,
    and picking the best of such differences picked the noise.)"""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> Any:
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor(prompts)
    clock = StepClock()
    start = time.perf_counter()
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens + 1,
        min_new_tokens=new_tokens + 1,
        pad_token_id=model.generation_config.pad_token_id,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    if len(clock.stamps) != new_tokens + 1:
        raise RuntimeError(f"expected {new_tokens + 1} generation steps, saw {len(clock.stamps)}")
    return {
        "prefill_tok_s": ids.numel() / (clock.stamps[0] - start),
        "decode_tok_s": len(prompts) * new_tokens / (clock.stamps[-1] - clock.stamps[0]),
    }


def spec_run(
    engine: Engine,
    prompts: list[list[int]],
    batch: int,
    k: int,
    new_tokens: int,
    shaping: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Greedy generation with k proposals per decode, the prompts taken `batch` at a time (one
    group after another, so batch 1 averages over every prompt rather than depending on one).
    Decode and prefill are timed apart: a draft model prefills each prompt with the target,
    so its cost shows in `prefill_tok_s`, not in the decode rate `tok_s`."""
    drafted = accepted = verify_steps = produced = 0
    draft_s = target_s = overhead_s = elapsed = prefill_s = 0.0
    for g in range(0, len(prompts), batch):
        reqs = _requests(prompts[g : g + batch], new_tokens, f"sp{batch}k{k}g{g}", shaping)
        for r in reqs:
            engine.add_request(r)
        start = time.perf_counter()
        engine.step(BatchPlan(tuple(PrefillChunk(r.request_id, r.prompt_len) for r in reqs)))
        prefill_s += time.perf_counter() - start
        start = time.perf_counter()
        live = [r.request_id for r in reqs if engine.finish_reason(r.request_id) is None]
        while live:
            outcome = engine.step(BatchPlan(tuple(DecodeStep(rid, k) for rid in live)))
            draft_s += outcome.draft_s
            target_s += outcome.target_s
            overhead_s += outcome.overhead_s
            for o in outcome.outcomes:
                drafted += o.num_draft_tokens
                accepted += o.num_accepted_tokens
                produced += len(o.new_token_ids)
                verify_steps += 1
            live = [rid for rid in live if engine.finish_reason(rid) is None]
        elapsed += time.perf_counter() - start
        for r in reqs:
            engine.abort(r.request_id)
    total = draft_s + target_s + overhead_s
    return {
        "tok_s": produced / elapsed,
        "prefill_tok_s": sum(len(p) for p in prompts) / prefill_s,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_len": produced / verify_steps,
        "drafts_per_verify": drafted / verify_steps,
        "time_split": {
            "draft": draft_s / total,
            "target": target_s / total,
            "overhead": overhead_s / total,
        },
    }


def best_of(repeats: int, measure: Callable[[], dict[str, Any]], key: str) -> dict[str, Any]:
    """The fastest of `repeats` identical runs by `key`; other figures are max'ed separately
    when they are rates (keys ending in _tok_s). The machine is shared, so single runs are
    noisy and the best run is the closest to the engine's own cost."""
    runs = [measure() for _ in range(repeats)]
    best = dict(max(runs, key=lambda r: r[key]))
    for name in best:
        if name.endswith("_tok_s"):
            best[name] = max(r[name] for r in runs)
    return best


def run(args: argparse.Namespace) -> int:
    check_model_folders(("--target", args.target), ("--draft", args.draft))
    torch.set_num_threads(args.threads)
    settings = Settings.for_run(args.quick)
    dtypes = list(DTYPES) if args.dtype == "all" else [args.dtype]
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    max_batch = max(settings.batches)
    prompts = stdlib_prompts(lambda text: tokenizer.encode(text).ids, max_batch, settings.context)
    num_blocks = kv_blocks_for(max_batch, settings.context + settings.spec_new_tokens)
    cases = 2 * len(dtypes) * len(settings.batches)
    cases += (
        len(dtypes) * len(settings.spec_batches) * (1 + 2 * sum(k > 0 for k in settings.spec_ks))
    )
    cases += 8 * len(settings.spec_batches)
    bar = tqdm(total=cases, desc="bench engine", unit="case")
    results: dict[str, Any] = {"throughput": [], "hf": [], "spec": []}

    engines = {}
    for name in dtypes:
        engine = Engine.from_dirs(args.target, num_blocks=num_blocks, dtype=DTYPES[name])
        engines[name] = engine
        engine_throughput(engine, prompts[:1], 2)
        for b in settings.batches:
            bar.set_postfix_str(f"engine {name} batch {b}")
            row = best_of(
                args.repeats,
                functools.partial(engine_throughput, engine, prompts[:b], settings.new_tokens),
                "decode_tok_s",
            )
            results["throughput"].append({"dtype": name, "batch": b, **row})
            bar.update()
    for name in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=DTYPES[name]).eval()
        hf_throughput(hf, prompts[:1], 2)
        for b in settings.batches:
            bar.set_postfix_str(f"transformers {name} batch {b}")
            row = best_of(
                args.repeats,
                functools.partial(hf_throughput, hf, prompts[:b], settings.new_tokens),
                "decode_tok_s",
            )
            results["hf"].append({"dtype": name, "batch": b, **row})
            bar.update()
        del hf

    best_dtype = _fastest_dtype(results["throughput"], max_batch)
    results["ratios"] = _ratios(results["throughput"], results["hf"])
    spec_dtype = _fastest_dtype(results["throughput"], 1)
    spec_prompts = prompts[: settings.spec_prompts]
    drafts = {name: draft_runner(engines[name].target, args.draft) for name in dtypes}
    for name in dtypes:
        target = engines[name].target
        for row in spec_cases(target, drafts[name], spec_prompts, settings, bar, args):
            results["spec"].append({"dtype": name, **row})
    for section, sampling in (("shaping", SHAPING), ("structured", STRUCTURED)):
        results[section] = shaping_cases(
            engines[spec_dtype],
            drafts[spec_dtype],
            spec_prompts,
            section,
            sampling,
            settings,
            bar,
            args,
        )
    bar.close()
    results["config"] = {
        "target": str(args.target),
        "draft": str(args.draft),
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "context": settings.context,
        "new_tokens": settings.new_tokens,
        "spec_new_tokens": settings.spec_new_tokens,
        "spec_prompts": settings.spec_prompts,
        "spec_dtype": spec_dtype,
        "torch": torch.__version__,
    }
    results["summary"] = _summary(results, best_dtype, max_batch, spec_dtype)
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps(results["summary"], indent=2))
    return 0


def spec_cases(
    target: ModelRunner,
    draft: ModelRunner,
    prompts: list[list[int]],
    settings: Settings,
    bar: tqdm,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Every speculation case on `target`'s dtype: k = 0, then each proposer and k."""
    proposers: list[ProposerKind] = ["draft", "ngram"]
    spec_ks = [k for k in settings.spec_ks if k > 0]
    rows = []
    for b in settings.spec_batches:
        bar.set_postfix_str(f"spec {target.dtype} baseline batch {b}")
        plain = Engine(target)
        baseline = best_of(
            args.repeats,
            functools.partial(spec_run, plain, prompts, b, 0, settings.spec_new_tokens),
            "tok_s",
        )
        rows.append({"proposer": "none", "batch": b, "k": 0, **baseline, "speedup": 1.0})
        bar.update()
        for proposer in proposers:
            engine = Engine(target, draft, proposer=proposer)
            for k in spec_ks:
                bar.set_postfix_str(f"spec {target.dtype} {proposer} batch {b} k {k}")
                row = best_of(
                    args.repeats,
                    functools.partial(spec_run, engine, prompts, b, k, settings.spec_new_tokens),
                    "tok_s",
                )
                speedup = row["tok_s"] / baseline["tok_s"]
                rows.append({"proposer": proposer, "batch": b, "k": k, **row, "speedup": speedup})
                bar.update()
    return rows


def kv_blocks_for(requests: int, tokens: int) -> int:
    """KV blocks for `requests` of `tokens` each, with a block of slack per request (drafts
    past the end) and a few spare."""
    return requests * -(-(tokens + 16) // 16) + 8


def draft_runner(target: ModelRunner, draft_dir: Path) -> ModelRunner:
    """The draft as the engine loads it, beside `target` (its dtype and cache size): loaded
    once per dtype, for the speculation and the shaping cases."""
    return ModelRunner(
        draft_dir,
        num_blocks=target.num_blocks,
        dtype=target.dtype,
        head_vocab=load_draft_vocab(draft_dir),
    )


def shaping_cases(
    loaded: Engine,
    draft: ModelRunner,
    prompts: list[list[int]],
    section: str,
    sampling: dict[str, Any],
    settings: Settings,
    bar: tqdm,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """Decode rate with and without `sampling` (`SHAPING` or `STRUCTURED`) on `loaded`'s
    target, measured in turn per case, and their ratio."""
    rows = []
    for b in settings.spec_batches:
        for proposer, k in (("none", 0), ("draft", SHAPING_K)):
            engine = Engine(
                loaded.target,
                draft,
                proposer=None if k == 0 else "draft",
                grammar_vocab=loaded.grammar_vocab,
            )
            rates = {}
            for shaped in (False, True):
                on = "on" if shaped else "off"
                bar.set_postfix_str(f"{section} {proposer} batch {b} {on}")
                measure = functools.partial(
                    spec_run,
                    engine,
                    prompts,
                    b,
                    k,
                    settings.spec_new_tokens,
                    sampling if shaped else None,
                )
                rates[shaped] = best_of(args.repeats, measure, "tok_s")
                bar.update()
            rows.append(
                {
                    "proposer": proposer,
                    "batch": b,
                    "k": k,
                    "plain_tok_s": rates[False]["tok_s"],
                    "shaped_tok_s": rates[True]["tok_s"],
                    "shaped_over_plain": rates[True]["tok_s"] / rates[False]["tok_s"],
                    "plain_acceptance": rates[False]["acceptance_rate"],
                    "shaped_acceptance": rates[True]["acceptance_rate"],
                }
            )
    return rows


def _fastest_dtype(rows: list[dict[str, Any]], batch: int) -> str:
    at_batch = [r for r in rows if r["batch"] == batch]
    return str(max(at_batch, key=lambda r: r["decode_tok_s"])["dtype"])


def _ratios(
    engine_rows: list[dict[str, Any]], hf_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Engine over transformers at the same batch and dtype."""
    out = []
    for hf_row in hf_rows:
        b, dtype = hf_row["batch"], hf_row["dtype"]
        for row in (r for r in engine_rows if r["batch"] == b and r["dtype"] == dtype):
            out.append(
                {
                    "batch": b,
                    "dtype": dtype,
                    "decode_ratio": row["decode_tok_s"] / hf_row["decode_tok_s"],
                    "prefill_ratio": row["prefill_tok_s"] / hf_row["prefill_tok_s"],
                }
            )
    return out


def _summary(
    results: dict[str, Any], best_dtype: str, max_batch: int, spec_dtype: str
) -> dict[str, Any]:
    """Headline figures at the largest batch measured (32 in a full run).

    The headline decode ratio compares each system at its own fastest dtype (what a user
    would run); the same-dtype ratios are reported next to it. Speculation headlines are for
    the dtype that decodes fastest at batch 1 without it; every dtype's best is listed too."""
    engine_best = max(r["decode_tok_s"] for r in results["throughput"] if r["batch"] == max_batch)
    hf_rows = [r for r in results["hf"] if r["batch"] == max_batch]
    hf_best = max(hf_rows, key=lambda r: r["decode_tok_s"])
    same_dtype = {
        r["dtype"]: r["decode_ratio"] for r in results["ratios"] if r["batch"] == max_batch
    }

    def best_b1(proposer: str, dtype: str) -> dict[str, Any]:
        rows = [
            r
            for r in results["spec"]
            if r["batch"] == 1 and r["proposer"] == proposer and r["dtype"] == dtype
        ]
        return max(rows, key=lambda r: r["speedup"])

    best = best_b1("draft", spec_dtype)
    best_ngram = best_b1("ngram", spec_dtype)
    dtypes = sorted({r["dtype"] for r in results["spec"]})
    return {
        "decode_ratio_vs_hf_b32": engine_best / hf_best["decode_tok_s"],
        "decode_ratio_same_dtype_b32": same_dtype,
        "largest_batch": max_batch,
        "engine_dtype_largest_batch": best_dtype,
        "hf_dtype_largest_batch": hf_best["dtype"],
        "spec_speedup_b1": best["speedup"],
        "spec_acceptance_b1": best["acceptance_rate"],
        "spec_best_k_b1": best["k"],
        "ngram_speedup_b1": best_ngram["speedup"],
        "ngram_best_k_b1": best_ngram["k"],
        "spec_dtype_b1": spec_dtype,
        "shaped_over_plain": {
            f"{r['proposer']}_b{r['batch']}": r["shaped_over_plain"] for r in results["shaping"]
        },
        "structured_over_plain": {
            f"{r['proposer']}_b{r['batch']}": r["shaped_over_plain"] for r in results["structured"]
        },
        "spec_b1_by_dtype": {
            d: {
                proposer: {
                    key: best_b1(proposer, d)[key]
                    for key in ("k", "speedup", "tok_s", "prefill_tok_s", "acceptance_rate")
                }
                for proposer in ("none", "draft", "ngram")
            }
            for d in dtypes
        },
    }
