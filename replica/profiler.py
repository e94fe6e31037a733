"""`slos-serve profile`: time the real engine over a grid of batches and fit a PerfModel.

Each grid point is one batch composition: prefill chunks (tokens, cached context), decoding
requests (cached context) and a speculation length for the decodes. For each point the profiler
builds that exact state in the engine (untimed setup prefills; one speculative step first so the
draft's cache has caught up, as in steady serving), runs one untimed warm-up step and then
`repeats` timed steps. A timed step is the whole `Engine.step` (draft + target + overhead: what
a planner's step really costs), by process CPU time or wall time (see CLOCKS). The grid is
visited `passes` times in shuffled orders and each point keeps the median of all its timings.
Between repeats, prefill requests are preempted and re-fed to their context so every repeat has
the same shape; decodes simply go on (their context grows by one or a few tokens, recorded in
the features as the mean over repeats).

The samples are fitted by replica.perf_fit on a seeded training split; the profile's r2 and
mape come from the held-out split.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import count
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from replica.arguments import fraction, non_negative_int, output_file, plot_file, positive_int
from replica.batch import BatchPlan, DecodeStep, PlanEntry, PrefillChunk
from replica.device import DTYPES, compute_device
from replica.engine import Engine
from replica.model_runner import BLOCK_SIZE, ModelConfig, ModelRunner
from replica.model_source import model_dir, model_folder
from replica.perf_fit import Sample, fit_profile, samples_to_json, split_samples
from replica.perf_model import BatchFeatures, BatchShape, PerfModel
from replica.request import Request, SamplingParams, Tier
from replica.tensor_parallel import join, leave

SETUP_CHUNK = 512
"""Setup prefills are fed in chunks of this many tokens (one request per step)."""
KV_BLOCKS = 4096
"""KV blocks for target and draft: room for the largest grid point and its setup."""
DEMO_KV_TOKENS = 1024 * 16
"""KV tokens of one CPU demo replica (deploy/serve-cpu.yaml: 1024 blocks of 16). Batches beyond
it never run there, and on this CPU they fall off a cliff the linear model should not bend to:
24 decodes at contexts 512-1536 took 3.3x the time of 16 (140 vs 42 ms), where 48 decodes at
256-768 with the same padded attention took 75 ms."""
Clock = Literal["cpu", "wall"]
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
"""How a step is timed. "cpu" (process CPU time) ignores the time other processes take the
core away, so a 1-thread profile taken on a shared machine still measures the step's own cost
(what it takes on an idle core); "wall" is what the engine reports, right on a quiet machine
and the only choice for a multi-threaded engine."""


@dataclass(frozen=True)
class GridPoint:
    """One batch composition to time."""

    prefills: tuple[tuple[int, int], ...] = ()
    """(chunk tokens, cached context) per prefilling request."""
    decodes: tuple[int, ...] = ()
    """Cached context per decoding request."""
    spec_tokens: int = 0
    """Speculation length k of every decode (needs a draft)."""

    def __post_init__(self) -> None:
        if not self.prefills and not self.decodes:
            raise ValueError("a grid point needs at least one prefill or decode")
        if self.spec_tokens < 0:
            raise ValueError(f"spec_tokens must be >= 0, got {self.spec_tokens}")
        if self.spec_tokens and not self.decodes:
            raise ValueError("spec_tokens needs decodes to speculate on")
        for chunk, context in self.prefills:
            if chunk < 1 or context < 0:
                raise ValueError(f"prefill (chunk={chunk}, context={context}) is invalid")
        if any(c < 1 for c in self.decodes):
            raise ValueError("decode contexts must be >= 1 (a decode follows a prompt)")

    def kv_tokens(self) -> int:
        """Tokens of the whole batch in the KV cache after the step (spec tokens included)."""
        prefill = sum(c + n for n, c in self.prefills)
        return prefill + sum(c + 1 + self.spec_tokens for c in self.decodes)

    def longest(self) -> int:
        """Most tokens any request of the point needs in the KV cache, spec tokens included."""
        return max(
            [c + n + 1 for n, c in self.prefills] + [c + 1 + self.spec_tokens for c in self.decodes]
        )


def spread(mean: int, count: int) -> tuple[int, ...]:
    """`count` contexts evenly from mean/2 to 3*mean/2: serving batches never share one context
    (and on CPU a batch of equal contexts skips the attention mask, an unrepresentative case)."""
    if count == 1:
        return (mean,)
    return tuple(mean // 2 + (mean * i) // (count - 1) for i in range(count))


def default_grid(
    *, speculative: bool, max_len: int = 2048, max_kv_tokens: int = DEMO_KV_TOKENS
) -> list[GridPoint]:
    """Prefill-only, prefill on context, decode-only, speculative and mixed batches that fit
    the model context and a replica's KV cache."""
    points = [GridPoint(prefills=((n, 0),)) for n in (8, 32, 64, 128, 256, 384, 512, 768, 1024)]
    points += [GridPoint(prefills=((n, c),)) for n in (32, 256) for c in (256, 1024)]
    points += [GridPoint(prefills=((n, 0),) * 4) for n in (32, 128)]
    points += [
        GridPoint(decodes=spread(c, b)) for c in (32, 256, 960) for b in (1, 2, 4, 8, 16, 32)
    ]
    points += [
        GridPoint(decodes=spread(c, b), prefills=((n, 0),))
        for b in (4, 16)
        for c in (64, 512)
        for n in (32, 128, 512)
    ]
    if speculative:
        points += [
            GridPoint(decodes=spread(c, b), spec_tokens=k)
            for b in (1, 4, 16)
            for k in (1, 2, 4)
            for c in (64, 512)
        ]
        points += [
            GridPoint(decodes=spread(256, b), prefills=((n, 0),), spec_tokens=2)
            for b in (4, 8)
            for n in (64, 256)
        ]
    return [p for p in points if p.longest() <= max_len - 16 and p.kv_tokens() <= max_kv_tokens]


def quick_grid(*, speculative: bool) -> list[GridPoint]:
    """A few-second grid of short contexts (smoke tests, CI). Its longest prompt stands
    clear of the noise of a demo model split over processes on shared cores: with 96 tokens
    at most, a 20 ms all-reduce floor jittering by several ms hid their price, and the fit
    refused a profile that charged none."""
    points = [GridPoint(prefills=((n, 0),)) for n in (4, 16, 64, 256)]
    points += [GridPoint(prefills=((16, 32),))]
    points += [GridPoint(decodes=spread(c, b)) for c in (8, 64) for b in (1, 4, 8)]
    points += [GridPoint(decodes=spread(16, 4), prefills=((32, 0),))]
    if speculative:
        points += [GridPoint(decodes=spread(16, b), spec_tokens=k) for b in (1, 4) for k in (1, 3)]
    return points


class _Profiler:
    """Builds grid points in one engine and times them."""

    def __init__(self, engine: Engine, repeats: int, clock: Clock) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.engine = engine
        self.repeats = repeats
        self.clock = CLOCKS[clock]
        self._ids = count()

    def _new_request(self, prompt_len: int, max_tokens: int) -> str:
        rid = f"profile-{next(self._ids)}"
        prompt = [(7 * i + 3) % self.engine.target.vocab_size for i in range(prompt_len)]
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(Request(rid, prompt, sampling, tier=Tier.BEST_EFFORT))
        return rid

    def _feed(self, rid: str, num_tokens: int) -> None:
        """Untimed setup: prefill `num_tokens` more tokens of one request."""
        while num_tokens > 0:
            chunk = min(SETUP_CHUNK, num_tokens)
            self.engine.step(BatchPlan((PrefillChunk(rid, chunk),)))
            num_tokens -= chunk

    def measure(self, point: GridPoint) -> tuple[list[float], list[BatchShape]]:
        """Seconds and shape of each timed repeat of the point."""
        engine = self.engine
        k = point.spec_tokens
        steps = self.repeats + 2
        decoders = [self._new_request(c, max_tokens=2 + steps * (k + 1)) for c in point.decodes]
        for rid, context in zip(decoders, point.decodes, strict=True):
            self._feed(rid, context)
        if k:
            engine.step(BatchPlan(tuple(DecodeStep(rid, k) for rid in decoders)))
        # Prompt one token longer than context + chunk, so the chunk never samples a token
        # and a preempted request re-feeds exactly the same tokens.
        prefillers = [self._new_request(c + n + 1, max_tokens=1) for n, c in point.prefills]
        times: list[float] = []
        shapes: list[BatchShape] = []
        try:
            for repeat in range(self.repeats + 1):
                for rid, (_, context) in zip(prefillers, point.prefills, strict=True):
                    engine.preempt(rid)
                    self._feed(rid, context)
                entries: list[PlanEntry] = [
                    PrefillChunk(rid, n)
                    for rid, (n, _) in zip(prefillers, point.prefills, strict=True)
                ]
                entries += [DecodeStep(rid, k) for rid in decoders]
                shape = self._shape(entries, k)
                started = self.clock()
                engine.step(BatchPlan(tuple(entries)))
                if repeat > 0:
                    times.append(self.clock() - started)
                    shapes.append(shape)
        finally:
            for rid in decoders + prefillers:
                engine.abort(rid)
        return times, shapes

    def _shape(self, entries: Sequence[PlanEntry], k: int) -> BatchShape:
        new_tokens = []
        context = []
        for entry in entries:
            rid = entry.request_id
            context.append(self.engine.num_computed_tokens(rid))
            new_tokens.append(entry.num_tokens if isinstance(entry, PrefillChunk) else k + 1)
        drafting = sum(1 for e in entries if isinstance(e, DecodeStep)) if k else 0
        return BatchShape(tuple(new_tokens), tuple(context), k if drafting else 0, drafting)


def _mean_features(shapes: Sequence[BatchShape]) -> BatchFeatures:
    """Features averaged over the repeats (decode contexts grow a little between them)."""
    features = [s.features() for s in shapes]

    def mean(name: str) -> int:
        return round(statistics.fmean(getattr(f, name) for f in features))

    return BatchFeatures(
        num_tokens=mean("num_tokens"),
        num_requests=mean("num_requests"),
        attn_tokens=mean("attn_tokens"),
        kv_tokens=mean("kv_tokens"),
        draft_steps=mean("draft_steps"),
        draft_batch=mean("draft_batch"),
        padded_attn_tokens=mean("padded_attn_tokens"),
    )


def check_clock(clock: Clock, device: torch.device, *, split: bool) -> None:
    """The cpu clock measures only this process's CPU time: a step's whole cost on one CPU
    thread, and no other case."""
    if clock != "cpu":
        return
    if device.type != "cpu":
        raise ValueError("the cpu clock does not see time spent on a GPU: use the wall clock")
    if split:
        raise ValueError(
            "the cpu clock sees this process only, not the other tensor-parallel ranks: "
            "use the wall clock"
        )
    if torch.get_num_threads() != 1:
        raise ValueError(
            f"the cpu clock sums every thread's time: use it with 1 torch thread, "
            f"not {torch.get_num_threads()}"
        )


def profile_engine(
    engine: Engine,
    grid: Sequence[GridPoint],
    *,
    repeats: int = 3,
    passes: int = 2,
    seed: int = 0,
    clock: Clock = "wall",
    progress: bool = True,
) -> list[Sample]:
    """One sample per grid point: the median over `passes` x `repeats` timed steps.

    Each pass visits the grid in a fresh seeded order, so a burst of load from other processes
    on the machine lands on a few repeats of many points instead of every repeat of a few."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    if any(p.spec_tokens for p in grid) and not engine.can_speculate:
        raise ValueError("the grid has speculative points but the engine has no draft model")
    too_long = [p for p in grid if p.longest() > engine.max_model_len]
    if too_long:
        raise ValueError(f"grid point {too_long[0]} exceeds the model context")
    check_clock(clock, engine.target.device, split=engine.target.tp is not None)
    profiler = _Profiler(engine, repeats, clock)
    for point in grid[:2]:
        profiler.measure(point)
    rng = random.Random(seed)
    order = [i for _ in range(passes) for i in rng.sample(range(len(grid)), len(grid))]
    visits: Iterable[int] = order
    if progress:
        visits = tqdm(order, desc="profiling", unit="batch", file=sys.stderr)
    times: list[list[float]] = [[] for _ in grid]
    shapes: list[list[BatchShape]] = [[] for _ in grid]
    for i in visits:
        point_times, point_shapes = profiler.measure(grid[i])
        times[i] += point_times
        shapes[i] += point_shapes
    return [
        Sample(_mean_features(s), statistics.median(t)) for t, s in zip(times, shapes, strict=True)
    ]


def plot_fit(model: PerfModel, samples: Sequence[Sample], path: Path) -> None:
    """Predicted vs measured (ms, log-log: steps span two decades) with y = x; held-out points
    highlighted, R^2 in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, test = split_samples(samples, model.info.fit["holdout_fraction"], model.info.fit["seed"])
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for subset, label, color in ((train, "train", "0.6"), (test, "held-out", "tab:blue")):
        measured = [s.seconds * 1e3 for s in subset]
        predicted = [model.predict_features(s.features) * 1e3 for s in subset]
        ax.scatter(measured, predicted, s=14, c=color, label=label)
    values = [s.seconds for s in samples] + [model.predict_features(s.features) for s in samples]
    low, high = 1e3 * min(values), 1e3 * max(values)
    ax.plot([low, high], [low, high], "k--", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    info = model.info
    ax.set_title(f"{info.model}: held-out R² = {info.r2:.3f}, MAPE = {100 * (info.mape or 0):.1f}%")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=Path, required=True, help="target model: HF folder or hub repo id"
    )
    parser.add_argument(
        "--draft", type=Path, help="draft model (folder or hub repo id): adds speculative points"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where to profile (cuda: the GPU this process sees; time it with --clock wall)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="split the target over N processes (one GPU each with --device cuda; gloo on cpu), "
        "as a replica with tensor_parallel_size N runs it; needs --clock wall",
    )
    parser.add_argument("--out", type=output_file, required=True, help="profile JSON to write")
    parser.add_argument("--plot", type=plot_file, help="PNG of predicted vs measured")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed repeats per visit")
    parser.add_argument("--passes", type=positive_int, default=3, help="visits of every grid point")
    parser.add_argument("--quick", action="store_true", help="small grid (seconds, for tests)")
    parser.add_argument(
        "--max-terms", type=positive_int, default=3, help="most linear terms in the max"
    )
    parser.add_argument("--holdout", type=fraction, default=0.25, help="held-out fraction")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the train/held-out split"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (serve-cpu.yaml: 1 per replica)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="time steps by process CPU time (robust on a shared machine; 1 thread) or wall time",
    )
    parser.add_argument(
        "--note", action="append", default=[], help="extra note for the profile (repeatable)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    size = args.tensor_parallel
    try:
        device, dtype = compute_device(args.device == "cuda", args.dtype, "--device cuda")
        check_clock(args.clock, device, split=size > 1)
        check_group_size(size, device)
        ModelConfig.from_dir(model_folder("--model", args.model)).sharded(size)
        if args.draft is not None:
            model_folder("--draft", args.draft)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"slos-serve profile: error: {exc}") from None
    if size == 1:
        engine = Engine.from_dirs(
            args.model, args.draft, num_blocks=KV_BLOCKS, device=device, dtype=dtype
        )
        return _profile(args, engine, started)
    return _profile_split(args, device, dtype, started)


def _profile_split(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, started: float
) -> int:
    """`_profile` on rank 0 of a target split over `args.tensor_parallel` processes, the others
    started here and rendezvousing in a temporary directory (all on this machine)."""
    size = args.tensor_parallel
    with tempfile.TemporaryDirectory(prefix="slos-serve-profile-") as rendezvous:
        address = (Path(rendezvous) / "group").as_uri()
        spawn = multiprocessing.get_context("spawn")
        ranks = [
            spawn.Process(
                target=_serve_rank,
                args=(rank, size, address, str(args.model), device.type, dtype, args.threads),
                name=f"tensor-parallel rank {rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for rank_process in ranks:
            rank_process.start()
        threading.Thread(target=_exit_if_a_rank_fails, args=(ranks,), daemon=True).start()
        tp = join(0, size, address, rank_device(device, 0))
        try:
            engine = Engine.from_dirs(
                args.model,
                args.draft,
                num_blocks=KV_BLOCKS,
                device=rank_device(device, 0),
                dtype=dtype,
                tp=tp,
            )
            return _profile(args, engine, started)
        finally:
            tp.send_batch(None)
            leave()
            for rank_process in ranks:
                rank_process.join()


def check_group_size(size: int, device: torch.device) -> None:
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"--tensor-parallel {size} needs {size} GPUs; this process sees "
            f"{torch.cuda.device_count()}"
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank, all of them visible to this machine's processes; ranks share a CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _serve_rank(
    rank: int, size: int, address: str, model: str, device: str, dtype: torch.dtype, threads: int
) -> None:
    """A rank > 0 of the profiled target (its own process): computes its share of every batch
    rank 0 times, until rank 0 stops the group."""
    torch.set_num_threads(threads)
    where = rank_device(torch.device(device), rank)
    runner = ModelRunner(
        model_dir(model),
        num_blocks=KV_BLOCKS,
        dtype=dtype,
        device=where,
        tp=join(rank, size, address, where),
    )
    runner.serve_batches()
    leave()


def _exit_if_a_rank_fails(ranks: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """A rank that dies leaves rank 0 waiting in a collective: end the run, naming it."""
    alive = list(ranks)
    while alive:
        multiprocessing.connection.wait([rank.sentinel for rank in alive])
        for rank in [rank for rank in alive if rank.exitcode is not None]:
            alive.remove(rank)
            if rank.exitcode:
                print(
                    f"slos-serve profile: error: {rank.name} exited with code {rank.exitcode}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)


def _profile(args: argparse.Namespace, engine: Engine, started: float) -> int:
    """Time the grid on `engine`, fit, and write the profile (and its plot)."""
    speculative = args.draft is not None
    if args.quick:
        grid = quick_grid(speculative=speculative)
    else:
        grid = default_grid(speculative=speculative, max_len=engine.max_model_len)
    samples = profile_engine(
        engine,
        grid,
        repeats=args.repeats,
        passes=args.passes,
        seed=args.seed,
        clock=args.clock,
        progress=not args.no_progress,
    )
    device = engine.target.device
    model = fit_profile(
        samples,
        backend=f"torch-{device.type}",
        device=f"cpu ({platform.machine()}, {torch.get_num_threads()} torch thread(s))"
        if device.type == "cpu"
        else torch.cuda.get_device_name(device),
        model=args.model.name,
        draft=args.draft.name if args.draft else None,
        dtype=str(engine.target.dtype).removeprefix("torch."),
        tp=args.tensor_parallel,
        date=datetime.now(UTC).date().isoformat(),
        notes=(
            f"Measured with `slos-serve profile` over {len(grid)} batch shapes, "
            f"{args.passes} passes x {args.repeats} repeats each (median), "
            f"{args.clock} clock, {args.threads} torch thread(s).",
            *args.note,
        ),
        max_terms=args.max_terms,
        holdout_fraction=args.holdout,
        seed=args.seed,
    )
    fit = {**model.info.fit, "samples": samples_to_json(samples)}
    target = engine.target
    kv_per_token = target.config.kv_bytes_per_block(target.dtype) // BLOCK_SIZE
    # What a DistServe-style simulation moves per token from a prefill to a decode replica.
    assumptions = {"kv_bytes_per_token_per_gpu": kv_per_token}
    model = PerfModel(model.terms, replace(model.info, fit=fit, assumptions=assumptions))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    if args.plot is not None:
        plot_fit(model, samples, args.plot)
    summary = {
        "out": str(args.out),
        "samples": len(samples),
        "r2": model.info.r2,
        "mape": model.info.mape,
        "terms": len(model.terms),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0
