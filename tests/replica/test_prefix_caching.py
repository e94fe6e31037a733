"""Prefix caching in the engine: a request that starts with tokens another request computed
reuses their KV in both models' caches, computes only the rest, and outputs what it would
have without the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine
from replica.model_runner import ModelRunner
from replica.request import Request, SamplingParams, Tier

SYSTEM = (
    "You are a careful Python reviewer. Read the code, name each bug, and suggest the "
    "smallest fix that keeps the public interface unchanged.\n\n"
)
TAILS = ["def add(a, b):\n    return a - b\n", "for i in range(10):\n    print(j)\n"]
BLOCK = 16


@pytest.fixture(scope="module")
def tokens(target_dir: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    return [tok.encode(SYSTEM + tail).ids for tail in TAILS]


def engine(runners: tuple[ModelRunner, ModelRunner], prefix_caching: bool) -> Engine:
    return Engine(*runners, proposer="draft", prefix_caching=prefix_caching)


def request(rid: str, prompt: list[int], **sampling: object) -> Request:
    params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    return Request(rid, prompt, params, tier=Tier.BEST_EFFORT)


def run(engine: Engine, req: Request, k: int = 3) -> tuple[list[int], int]:
    """The request's output with speculative decodes of k, and the prompt tokens it took
    from the cache."""
    rid = req.request_id
    engine.add_request(req)
    cached = engine.attach_prefix(rid)
    engine.step(BatchPlan((PrefillChunk(rid, req.prompt_len - cached),)))
    while engine.finish_reason(rid) is None:
        engine.step(BatchPlan((DecodeStep(rid, k),)))
    out = engine.output_token_ids(rid)
    engine.abort(rid)
    return out, cached


@pytest.fixture(scope="module")
def plain(runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy output without the cache."""
    e = engine(runners, prefix_caching=False)
    return [run(e, request(f"p{i}", t))[0] for i, t in enumerate(tokens)]


def shared_blocks(tokens: list[list[int]]) -> int:
    common = next(i for i, (a, b) in enumerate(zip(*tokens, strict=False)) if a != b)
    return common // BLOCK


def test_a_request_sharing_a_prefix_computes_only_the_rest_and_outputs_the_same(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]], plain: list[list[int]]
) -> None:
    e = engine(runners, prefix_caching=True)
    first, cached = run(e, request("a", tokens[0]))
    assert cached == 0 and first == plain[0]
    assert shared_blocks(tokens) >= 2
    second, cached = run(e, request("b", tokens[1]))
    assert cached == shared_blocks(tokens) * BLOCK
    assert second == plain[1]
    assert e.num_free_blocks == e.cache.num_blocks  # cached blocks count as free


def test_a_conversation_s_next_turn_reuses_the_last_turn_s_output(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]], target_dir: Path
) -> None:
    e = engine(runners, prefix_caching=True)
    answer, _ = run(e, request("turn-1", tokens[0], max_tokens=40))
    follow_up = Tokenizer.from_file(str(target_dir / "tokenizer.json")).encode("\nAnd?").ids
    history = [*tokens[0], *answer, *follow_up]
    # Blocks are registered once computed: all but the answer's last token (never fed).
    computed = len(tokens[0]) + len(answer) - 1
    again, cached = run(e, request("turn-2", history))
    assert cached == computed // BLOCK * BLOCK > len(tokens[0])
    reference, _ = run(engine(runners, prefix_caching=False), request("ref", history))
    assert again == reference


def test_a_preempted_request_resumes_from_its_own_cached_blocks(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]], plain: list[list[int]]
) -> None:
    e = engine(runners, prefix_caching=True)
    rid = "pre"
    e.add_request(request(rid, tokens[0]))
    e.step(BatchPlan((PrefillChunk(rid, len(tokens[0])),)))
    for _ in range(3):
        e.step(BatchPlan((DecodeStep(rid, 2),)))
    e.preempt(rid)
    assert e.num_computed_tokens(rid) == 0 and e.cache.num_cached_blocks > 0
    known = len(tokens[0]) + len(e.output_token_ids(rid))
    cached = e.attach_prefix(rid)
    assert 0 < cached <= known - 1
    e.step(BatchPlan((PrefillChunk(rid, known - cached),)))
    while e.finish_reason(rid) is None:
        e.step(BatchPlan((DecodeStep(rid, 2),)))
    assert e.output_token_ids(rid) == plain[0]
    e.abort(rid)


def test_a_preempted_request_is_left_a_prefill_even_when_all_its_blocks_are_cached(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]]
) -> None:
    """With every token but the last in cached blocks, attaching them all would leave the
    request decoding, and the prefill the controller plans for a preempted request would no
    longer apply (the replica drops prefill chunks of decoding requests)."""
    e = engine(runners, prefix_caching=True)
    rid = "edge"
    e.add_request(request(rid, tokens[0], max_tokens=40))
    e.step(BatchPlan((PrefillChunk(rid, len(tokens[0])),)))
    known = len(tokens[0])
    while (known - 1) % BLOCK or known - 1 == len(tokens[0]) // BLOCK * BLOCK:
        e.step(BatchPlan((DecodeStep(rid, 0),)))
        known = len(tokens[0]) + len(e.output_token_ids(rid))
    e.preempt(rid)
    cached = e.attach_prefix(rid)
    assert cached == known - 1 - BLOCK  # one whole block left to prefill with the last token
    e.step(BatchPlan((PrefillChunk(rid, known - cached),)))
    assert e.num_computed_tokens(rid) == known
    e.abort(rid)


def test_seeded_sampling_and_prompt_logprobs_with_the_cache(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]]
) -> None:
    """A seeded request draws the same with and without a hit; one asking for prompt
    log-probabilities computes its whole prompt (they come from its logits)."""
    seeded = {"temperature": 0.8, "seed": 7}
    reference, _ = run(engine(runners, prefix_caching=False), request("s", tokens[1], **seeded))
    e = engine(runners, prefix_caching=True)
    run(e, request("warm", tokens[0]))
    out, cached = run(e, request("s", tokens[1], **seeded))
    assert cached > 0 and out == reference
    _, cached = run(e, request("lp", tokens[1], prompt_logprobs=1))
    assert cached == 0


def test_a_plan_that_preempts_a_sharing_request_counts_only_what_it_frees(
    runners: tuple[ModelRunner, ModelRunner], tokens: list[list[int]]
) -> None:
    """Preempting a request frees only the blocks nobody else reads: a plan that needs more
    is refused before anything changes, instead of running out of blocks midway."""
    e = engine(runners, prefix_caching=True)
    e.add_request(request("a", tokens[0]))
    e.step(BatchPlan((PrefillChunk("a", len(tokens[0])),)))  # a holds its blocks: decoding
    e.add_request(request("b", tokens[0]))
    shared = e.attach_prefix("b") // BLOCK
    assert shared > 0 and e.draft is not None
    assert e.draft.cache.num_tokens("b") == shared * BLOCK  # the draft's KV too
    e.step(BatchPlan((PrefillChunk("b", len(tokens[0]) - shared * BLOCK),)))
    free = e.num_free_blocks
    released = e.cache.blocks_released_by(["b"])
    assert released == len(e.cache.block_table("b")) - shared
    huge = (free + released + 1) * BLOCK
    e.add_request(request("c", [5] * huge, max_tokens=1))
    with pytest.raises(ValueError, match="KV blocks"):
        e.step(BatchPlan((PrefillChunk("c", huge),), preempt=("b",)))
    assert e.num_computed_tokens("b") > 0 and e.num_free_blocks == free
    for rid in ("a", "b", "c"):
        e.abort(rid)
