"""LocalReplica on the real engine and the demo target: concurrency must not change a token."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from replica.batch import BatchPlan, DecodeStep, FinishReason, PrefillChunk
from replica.engine import Engine
from replica.local import LocalReplica, TokenChunk, cache_budget
from replica.planner.base import CacheBudget
from replica.planner.sarathi import SarathiConfig, SarathiScheduler
from replica.planner.vllm import VllmConfig, VllmScheduler
from replica.request import Request, SamplingParams, Tier

torch.set_num_threads(2)

CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):\n    print(",
]


class RecordingVllm(VllmScheduler):
    """The real scheduler, remembering whom it preempted."""

    def __init__(self, budget: CacheBudget, config: VllmConfig) -> None:
        super().__init__(budget, config)
        self.preempted: list[str] = []

    def schedule(self, now: float) -> BatchPlan | None:
        plan = super().schedule(now)
        if plan is not None:
            self.preempted += plan.preempt
        return plan


@pytest.fixture(scope="module")
def prompts(target_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in CODE_PROMPTS]


@pytest.fixture(scope="module")
def greedy(target_dir: Path) -> Callable[[Request], list[int]]:
    """Standalone greedy output per request, computed once per (id, prompt, sampling)."""
    engine = Engine.from_dirs(target_dir, num_blocks=64)
    cache: dict[tuple[str, tuple[int, ...], SamplingParams], list[int]] = {}

    def output(req: Request) -> list[int]:
        key = (req.request_id, tuple(req.prompt_token_ids), req.sampling)
        if key not in cache:
            cache[key] = standalone(engine, req)
        return cache[key]

    return output


def request(request_id: str, prompt: list[int], max_tokens: int = 12, **sampling) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    return Request(request_id, prompt, params, tier=Tier.BEST_EFFORT)


def standalone(engine: Engine, req: Request) -> list[int]:
    """The request alone on the engine: one whole-prompt prefill, then plain decodes."""
    engine.add_request(req)
    plan = BatchPlan((PrefillChunk(req.request_id, req.prompt_len),))
    tokens: list[int] = []
    while True:
        result = engine.step(plan).outcomes[0]
        tokens += result.new_token_ids
        if result.finished:
            engine.abort(req.request_id)
            return tokens
        plan = BatchPlan((DecodeStep(req.request_id),))


async def collect(replica: LocalReplica, req: Request) -> list[TokenChunk]:
    return [chunk async for chunk in replica.generate(req)]


def tokens_of(chunks: list[TokenChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def serve_all(
    replica: LocalReplica, reqs: list[Request]
) -> list[list[TokenChunk] | BaseException]:
    await replica.start()
    try:
        return await asyncio.gather(*(collect(replica, r) for r in reqs), return_exceptions=True)
    finally:
        await replica.stop()


@pytest.mark.parametrize(
    ("num_blocks", "proposer", "make_scheduler"),
    [
        (64, None, lambda b: VllmScheduler(b)),
        (64, None, lambda b: SarathiScheduler(b, SarathiConfig(token_budget=8))),
        (64, "ngram", lambda b: SarathiScheduler(b, SarathiConfig(token_budget=8, spec_k=3))),
        (5, "ngram", lambda b: RecordingVllm(b, VllmConfig(spec_k=2))),
    ],
    ids=["vllm", "sarathi-chunks", "sarathi-spec", "vllm-spec-preempting"],
)
def test_concurrent_requests_match_the_standalone_greedy_output(
    target_dir, prompts, greedy, num_blocks, proposer, make_scheduler
):
    reqs = [request(f"r{i}", p, max_tokens=16) for i, p in enumerate(prompts)]
    expected = [greedy(r) for r in reqs]

    engine = Engine.from_dirs(target_dir, num_blocks=num_blocks, proposer=proposer)
    replica = LocalReplica(engine, make_scheduler(cache_budget(engine)))
    results = asyncio.run(serve_all(replica, reqs))

    assert [tokens_of(chunks) for chunks in results] == expected
    for chunks in results:
        assert all(not c.finished for c in chunks[:-1])
        assert chunks[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert engine.num_free_blocks == num_blocks
    assert not replica.scheduler.has_unfinished()
    if isinstance(replica.scheduler, RecordingVllm):
        # 5 blocks cannot hold the 4 requests: recomputation after preemption changed nothing.
        assert replica.scheduler.preempted


def test_final_record_has_arrival_and_one_time_per_token(target_dir, prompts):
    ticks = itertools.count()
    engine = Engine.from_dirs(target_dir, num_blocks=64)
    replica = LocalReplica(engine, VllmScheduler(cache_budget(engine)), clock=lambda: next(ticks))
    [chunks] = asyncio.run(
        serve_all(replica, [request("a", prompts[0], max_tokens=5, ignore_eos=True)])
    )
    timings = chunks[-1].timings
    assert timings is not None
    assert len(timings.token_times) == len(tokens_of(chunks)) == 5
    assert timings.arrival_time < timings.token_times[0] == timings.first_token_time
    assert list(timings.token_times) == sorted(timings.token_times)
    assert timings.ttft == timings.token_times[0] - timings.arrival_time
    assert timings.finish_time >= timings.token_times[-1]


def test_abort_ends_the_stream_and_frees_kv(target_dir, prompts, greedy):
    engine = Engine.from_dirs(target_dir, num_blocks=32)
    replica = LocalReplica(engine, SarathiScheduler(cache_budget(engine)))

    async def scenario() -> tuple[list[TokenChunk], list[TokenChunk]]:
        await replica.start()
        aborted = replica.generate(request("aborted", prompts[1], 400, ignore_eos=True))
        first = await anext(aborted)
        replica.abort("aborted")
        rest = [first] + [c async for c in aborted]
        # A client that stops reading aborts its request the same way.
        gone = replica.generate(request("gone", prompts[2], 400, ignore_eos=True))
        await anext(gone)
        await gone.aclose()
        survivor = await collect(replica, request("survivor", prompts[0], 6))
        await replica.stop()
        return rest, survivor

    aborted, survivor = asyncio.run(scenario())
    assert aborted[-1].finish_reason is FinishReason.ABORT
    assert len(tokens_of(aborted)) < 400
    assert tokens_of(survivor) == greedy(request("survivor", prompts[0], 6))
    assert engine.num_free_blocks == 32
    assert not engine.has_request("aborted") and not engine.has_request("gone")
    assert not replica.scheduler.has_unfinished()


def test_a_bad_request_fails_on_its_own_stream_only(target_dir, prompts, greedy):
    engine = Engine.from_dirs(target_dir, num_blocks=64)
    scheduler = VllmScheduler(cache_budget(engine), VllmConfig(max_num_batched_tokens=64))
    replica = LocalReplica(engine, scheduler)
    reqs = [
        request("good0", prompts[0]),
        request("out-of-vocab", [5, 4096, 7]),
        request("too-long-for-the-model", prompts[1], max_tokens=4000),
        request("too-long-for-the-scheduler", prompts[2], max_tokens=60),
        request("good1", prompts[3]),
    ]
    results = asyncio.run(serve_all(replica, reqs))

    errors = {
        r.request_id: str(res)
        for r, res in zip(reqs, results, strict=True)
        if isinstance(res, ValueError)
    }
    assert set(errors) == {"out-of-vocab", "too-long-for-the-model", "too-long-for-the-scheduler"}
    assert "vocabulary" in errors["out-of-vocab"]
    assert "context" in errors["too-long-for-the-model"]
    assert "max_num_batched_tokens" in errors["too-long-for-the-scheduler"]
    assert tokens_of(results[0]) == greedy(reqs[0])  # type: ignore[arg-type]
    assert tokens_of(results[4]) == greedy(reqs[4])  # type: ignore[arg-type]
    assert engine.num_free_blocks == 64


def test_duplicate_ids_and_unstarted_replicas_are_refused(target_dir, prompts):
    engine = Engine.from_dirs(target_dir, num_blocks=64)
    replica = LocalReplica(engine, VllmScheduler(cache_budget(engine)))

    async def scenario() -> None:
        with pytest.raises(RuntimeError, match="not started"):
            await anext(replica.generate(request("a", prompts[0])))
        await replica.start()
        first = replica.generate(request("a", prompts[0], 20, ignore_eos=True))
        chunks = [await anext(first)]
        with pytest.raises(ValueError, match="already being served"):
            await anext(replica.generate(request("a", prompts[1])))
        chunks += [c async for c in first]
        # The refused duplicate left the first request alone.
        assert len(tokens_of(chunks)) == 20
        assert chunks[-1].finish_reason is FinishReason.LENGTH
        await replica.stop()

    asyncio.run(scenario())


class CountingScheduler(SarathiScheduler):
    """The real scheduler, counting how often the loop asks it for a plan."""

    calls = 0

    def schedule(self, now: float) -> BatchPlan | None:
        self.calls += 1
        return super().schedule(now)


def test_an_idle_replica_waits_instead_of_polling(target_dir, prompts):
    engine = Engine.from_dirs(target_dir, num_blocks=64)
    scheduler = CountingScheduler(cache_budget(engine))
    replica = LocalReplica(engine, scheduler)

    async def scenario() -> tuple[int, int]:
        await replica.start()
        await asyncio.sleep(0.05)
        idle = scheduler.calls
        await collect(replica, request("a", prompts[0], 3, ignore_eos=True))
        busy = scheduler.calls
        await asyncio.sleep(0.05)
        await replica.stop()
        return idle, scheduler.calls - busy

    idle, after = asyncio.run(scenario())
    assert idle == 1
    assert after <= 1
