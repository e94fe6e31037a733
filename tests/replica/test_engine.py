"""The engine against transformers' greedy generate, under every way of batching requests,
plus stop conditions, seeded sampling and refusal of bad plans."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from replica.batch import BatchPlan, DecodeStep, FinishReason, PlanEntry, PrefillChunk
from replica.engine import Engine
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier
from tests.replica.engine_runs import load_detokenizer

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox",
    "import torch\nimport numpy as np\n\nclass Model:",
    "Hello",
    "1, 2, 3, 4, 5,",
    "SELECT name FROM users WHERE",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def prompts(target_dir: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def reference(target_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy output per prompt, cut after the first EOS as generate does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=1
        )[0, len(p) :].tolist()
        outs.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    return outs


@pytest.fixture(scope="module")
def target(target_dir: Path) -> ModelRunner:
    return ModelRunner(target_dir, num_blocks=48)


@pytest.fixture
def engine(target: ModelRunner, target_dir: Path) -> Engine:
    return Engine(target, detokenize=load_detokenizer(target_dir))


def _req(rid: str, prompt: list[int], **sampling: object) -> Request:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, **sampling})  # type: ignore[arg-type]
    return Request(rid, prompt, params, tier=Tier.BEST_EFFORT)


def _uncomputed(engine: Engine, rid: str, prompt_len: int) -> int:
    return prompt_len + len(engine.output_token_ids(rid)) - engine.num_computed_tokens(rid)


def _drive(
    engine: Engine,
    prompts: list[list[int]],
    arrivals: list[int],
    chunk: int | None,
    rng: random.Random | None = None,
) -> list[list[int]]:
    """A small scheduler: arrivals by step; chunked prefill (fixed or random chunk sizes)
    mixed with decodes in the same batch; runs until every request finishes."""
    ids = [f"q{i}" for i in range(len(prompts))]
    step = 0
    while step <= max(arrivals) or any(
        engine.has_request(r) and engine.finish_reason(r) is None for r in ids
    ):
        entries: list[PlanEntry] = []
        for rid, p, arrive in zip(ids, prompts, arrivals, strict=True):
            if arrive == step:
                engine.add_request(_req(rid, p))
            if not engine.has_request(rid) or engine.finish_reason(rid) is not None:
                continue
            left = _uncomputed(engine, rid, len(p))
            if engine.output_token_ids(rid) and left == 1:
                entries.append(DecodeStep(rid))
            else:
                size = rng.randint(1, left) if rng is not None else min(chunk or left, left)
                entries.append(PrefillChunk(rid, size))
        if entries:
            engine.step(BatchPlan(tuple(entries)))
        step += 1
    outputs = [engine.output_token_ids(r) for r in ids]
    for r in ids:
        engine.abort(r)
    assert engine.num_free_blocks == engine.cache.num_blocks
    return outputs


def test_all_together_matches_transformers(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert _drive(engine, prompts, [0] * len(prompts), chunk=None) == reference


def test_staggered_arrivals_match_transformers(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    arrivals = [0, 1, 3, 4, 7, 12]
    assert _drive(engine, prompts, arrivals, chunk=None) == reference


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 13, 64])
def test_chunked_prefill_mixed_with_decodes_matches_transformers(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]], chunk: int
) -> None:
    arrivals = [0, 0, 2, 3, 5, 6]
    assert _drive(engine, prompts, arrivals, chunk=chunk) == reference


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules_match_transformers(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]], seed: int
) -> None:
    rng = random.Random(seed)
    arrivals = [rng.randint(0, 8) for _ in prompts]
    assert _drive(engine, prompts, arrivals, chunk=None, rng=rng) == reference


def test_preempted_request_resumes_to_the_same_output(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    p = prompts[2]
    engine.add_request(_req("a", p))
    engine.step(BatchPlan((PrefillChunk("a", len(p)),)))
    for _ in range(3):
        engine.step(BatchPlan((DecodeStep("a"),)))
    engine.add_request(_req("b", prompts[0]))
    outcome = engine.step(BatchPlan((PrefillChunk("b", 4),), preempt=("a",)))
    assert engine.cache.num_tokens("a") == 0
    assert engine.num_computed_tokens("a") == 0
    assert outcome.free_blocks == engine.num_free_blocks
    known = len(p) + len(engine.output_token_ids("a"))
    engine.step(BatchPlan((PrefillChunk("a", known - 5),)))
    engine.step(BatchPlan((PrefillChunk("a", 5),)))
    while engine.finish_reason("a") is None:
        engine.step(BatchPlan((DecodeStep("a"),)))
    assert engine.output_token_ids("a") == reference[2]


def test_outcome_reports_tokens_counts_and_times(engine: Engine, prompts: list[list[int]]) -> None:
    p = prompts[0]
    engine.add_request(_req("a", p))
    first = engine.step(BatchPlan((PrefillChunk("a", 3),)))
    assert first.outcomes[0].new_token_ids == []
    assert first.outcomes[0].num_computed_tokens == 3
    second = engine.step(BatchPlan((PrefillChunk("a", len(p) - 3),)))
    out = second.outcomes[0]
    assert len(out.new_token_ids) == 1
    assert out.num_computed_tokens == len(p)
    assert second.target_s > 0 and second.overhead_s >= 0 and second.draft_s == 0
    assert second.free_blocks == engine.num_free_blocks < engine.cache.num_blocks


def test_max_tokens_finishes_with_length(engine: Engine, prompts: list[list[int]]) -> None:
    engine.add_request(_req("a", prompts[1], max_tokens=3, ignore_eos=True))
    engine.step(BatchPlan((PrefillChunk("a", len(prompts[1])),)))
    reasons = [engine.step(BatchPlan((DecodeStep("a"),))).outcomes[0].finish_reason for _ in "ab"]
    assert reasons == [None, FinishReason.LENGTH]
    assert len(engine.output_token_ids("a")) == 3
    assert engine.cache.num_tokens("a") == 0
    with pytest.raises(ValueError, match="already finished"):
        engine.step(BatchPlan((DecodeStep("a"),)))


def _run_single(engine: Engine, request: Request) -> list[int]:
    engine.add_request(request)
    engine.step(BatchPlan((PrefillChunk(request.request_id, request.prompt_len),)))
    while engine.finish_reason(request.request_id) is None:
        engine.step(BatchPlan((DecodeStep(request.request_id),)))
    out = engine.output_token_ids(request.request_id)
    engine.abort(request.request_id)
    return out


def test_eos_stops_unless_ignored(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    ref = reference[1]
    engine.eos_token_ids = frozenset({ref[3]})
    cut = ref.index(ref[3]) + 1
    assert _run_single(engine, _req("a", prompts[1])) == ref[:cut]
    assert _run_single(engine, _req("b", prompts[1], ignore_eos=True)) == ref


def test_a_stop_string_ends_output_at_the_token_completing_it(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]], target_dir: Path
) -> None:
    """The token whose text completes the stop string is the last (the front door cuts the
    text before the stop string; router.stops)."""
    detok = load_detokenizer(target_dir)
    assert detok is not None
    ref = reference[0]
    text = detok(ref)
    boundaries = {len(detok(ref[:n])) for n in range(len(ref) + 1)}
    stop = next(
        text[i : i + 3]
        for i in range(len(detok(ref[:2])), len(text) - 3)
        if i not in boundaries and text.find(text[i : i + 3]) == i  # first, inside a token
    )
    want = next(n for n in range(1, len(ref) + 1) if stop in detok(ref[:n]))
    assert want < len(ref)
    assert _run_single(engine, _req("a", prompts[0], stop=(stop,))) == ref[:want]


def test_seeded_sampling_is_reproducible(engine: Engine, prompts: list[list[int]]) -> None:
    def run(rid: str, seed: int) -> list[int]:
        return _run_single(
            engine, _req(rid, prompts[3], temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        )

    first, again, other = run("a", 11), run("b", 11), run("c", 12)
    assert first == again
    assert first != other


@pytest.mark.parametrize("seed", [None, 11])
def test_a_temperature_too_small_to_divide_by_samples_greedily(
    engine: Engine, prompts: list[list[int]], reference: list[list[int]], seed: int | None
) -> None:
    """1e-40 overflowed the fp32 logits it divided: the NaN rows crashed the step (unseeded)
    or drew EOS at once (seeded)."""
    tiny = _req("a", prompts[0], temperature=1e-40, seed=seed)
    assert tiny.sampling.greedy
    assert _run_single(engine, tiny) == reference[0]


def _snapshot(engine: Engine, rid: str) -> tuple[list[int], int, list[int], torch.Tensor]:
    table = engine.cache.block_table(rid)
    kv = engine.target.kv[:, table].clone()
    return engine.output_token_ids(rid), engine.num_computed_tokens(rid), table, kv


def test_bad_plans_are_refused_without_touching_any_request(
    engine: Engine, prompts: list[list[int]]
) -> None:
    engine.add_request(_req("a", prompts[0]))
    engine.add_request(_req("fresh", prompts[1]))
    engine.step(BatchPlan((PrefillChunk("a", len(prompts[0])),)))
    engine.step(BatchPlan((DecodeStep("a"),)))
    engine.add_request(_req("huge", [7] * (16 * 48)))
    before = _snapshot(engine, "a")
    free = engine.num_free_blocks
    bad_plans = {
        "unknown request": BatchPlan((DecodeStep("a"), DecodeStep("ghost"))),
        "only": BatchPlan((DecodeStep("a"), PrefillChunk("fresh", len(prompts[1]) + 1))),
        "not decoding": BatchPlan((DecodeStep("a"), DecodeStep("fresh"))),
        "no proposer": BatchPlan((DecodeStep("a", 2),)),
        "KV blocks": BatchPlan((DecodeStep("a"), PrefillChunk("huge", 16 * 48))),
    }
    for message, plan in bad_plans.items():
        with pytest.raises(ValueError, match=message):
            engine.step(plan)
        after = _snapshot(engine, "a")
        assert after[:3] == before[:3]
        assert torch.equal(after[3], before[3])
        assert engine.num_computed_tokens("fresh") == 0
        assert engine.num_free_blocks == free
    for rid in ("a", "fresh", "huge"):
        engine.abort(rid)


def test_bad_requests_are_refused(target: ModelRunner, engine: Engine) -> None:
    engine.add_request(_req("a", [5, 6]))
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request(_req("a", [5, 6]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(_req("b", [target.vocab_size]))
    with pytest.raises(ValueError, match="exceeds the model context"):
        engine.add_request(_req("c", [5] * (engine.max_model_len - 2)))
    with pytest.raises(ValueError, match="unknown request"):
        engine.abort("zzz")
    bare = Engine(target)
    with pytest.raises(ValueError, match="need a tokenizer"):
        bare.add_request(_req("d", [5], stop=("x",)))
    engine.abort("a")
