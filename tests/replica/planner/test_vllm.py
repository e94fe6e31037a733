"""The prefill-first baseline on a token-count engine (fixtures in conftest.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.batch import DecodeStep, PrefillChunk
from replica.planner.base import CacheBudget
from replica.planner.vllm import VllmConfig, VllmScheduler


def make(num_blocks: int = 64, block_size: int = 4, **config: int) -> VllmScheduler:
    return VllmScheduler(CacheBudget(num_blocks, block_size), VllmConfig(**config))


def test_whole_prompts_fcfs_within_the_token_budget_then_decodes(
    counting_engine, add, step, new_request
):
    sched = make(max_num_batched_tokens=25)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, *(new_request(rid, 10, 4) for rid in "abc"))
    assert step(sched, engine).entries == (PrefillChunk("a", 10), PrefillChunk("b", 10))
    # Prefill-first: c's prefill stalls the decodes of a and b.
    assert step(sched, engine).entries == (PrefillChunk("c", 10),)
    assert step(sched, engine).entries == tuple(DecodeStep(rid) for rid in "abc")


def test_head_of_line_request_blocks_smaller_ones_behind_it(
    counting_engine, add, step, new_request
):
    sched = make(max_num_batched_tokens=25)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 10, 2), new_request("b", 20, 2), new_request("c", 2, 2))
    assert step(sched, engine).entries == (PrefillChunk("a", 10),)
    assert step(sched, engine).entries == (PrefillChunk("b", 20), PrefillChunk("c", 2))


def test_max_num_seqs_caps_running_requests(counting_engine, add, step, new_request):
    sched = make(max_num_seqs=2)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, *(new_request(rid, 3, 2) for rid in "abc"))
    assert step(sched, engine).entries == (PrefillChunk("a", 3), PrefillChunk("b", 3))
    assert step(sched, engine).entries == (DecodeStep("a"), DecodeStep("b"))
    assert step(sched, engine).entries == (PrefillChunk("c", 3),)


def test_admission_waits_for_memory_of_the_prompt_and_its_first_decode(
    counting_engine, add, step, new_request
):
    sched = make(num_blocks=6)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 12, 2), new_request("b", 12, 2))
    # a takes 3 blocks and reserves a 4th for its first decode; b would need 4 of the other 2.
    assert step(sched, engine).entries == (PrefillChunk("a", 12),)
    assert step(sched, engine).entries == (DecodeStep("a"),)
    assert step(sched, engine).entries == (PrefillChunk("b", 12),)
    assert engine.peak_blocks <= 6


def test_preempts_the_newest_and_resumes_it_with_its_tokens(
    counting_engine, workload, new_request, expected
):
    sched = make(num_blocks=4)
    engine = counting_engine(sched.queues.budget)
    a, b = new_request("a", 4, 6), new_request("b", 4, 6)
    plans = workload(sched, engine, [(0, a), (0, b)])
    victim = next(i for i, p in enumerate(plans) if p.preempt)
    # Both hold 2 blocks at 8 tokens; a's 9th token needs a third block: b gives way.
    assert plans[victim].preempt == ("b",)
    assert plans[victim].entries == (DecodeStep("a"),)
    # b resumes with prompt + its 5 tokens in one chunk, and samples its 6th.
    assert plans[victim + 1].entries == (PrefillChunk("b", 9),)
    assert engine.finished == {"a": expected(a), "b": expected(b)}
    assert engine.peak_blocks <= 4


def test_speculative_slots_are_bounded_and_count_as_memory(
    counting_engine, workload, new_request, expected
):
    def plans_with(spec_k: int) -> list:
        sched = make(num_blocks=4, spec_k=spec_k)
        engine = counting_engine(sched.queues.budget, accept=lambda _rid, _k: 0)
        a, b = new_request("a", 4, 8), new_request("b", 4, 8)
        plans = workload(sched, engine, [(0, a), (0, b)])
        assert engine.finished == {"a": expected(a), "b": expected(b)}
        return plans

    # With 3 drafts rejected, a's second verify needs slots 6..9: a third block, so b goes.
    speculative = plans_with(3)[2]
    assert speculative.preempt == ("b",)
    assert speculative.entries == (DecodeStep("a", 3),)
    # Without drafts the same step needs slot 6 only: both decode.
    plain = plans_with(0)[2]
    assert plain.preempt == ()
    assert plain.entries == (DecodeStep("a"), DecodeStep("b"))


def test_speculation_never_exceeds_max_tokens(counting_engine, add, step, new_request, expected):
    sched = make(spec_k=3)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 4, 3))
    step(sched, engine)
    assert step(sched, engine).entries == (DecodeStep("a", 1),)
    assert engine.finished == {"a": expected(new_request("a", 4, 3))}
    assert not sched.has_unfinished()


def test_abort_frees_blocks_for_the_next_plan(counting_engine, add, step, new_request):
    sched = make(num_blocks=4)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 8, 4), new_request("b", 8, 4), new_request("c", 1, 1))
    assert step(sched, engine).entries == (PrefillChunk("a", 8),)
    assert sched.queues.used_blocks() == 2
    sched.abort_request("a")
    engine.abort("a")
    sched.abort_request("c")
    sched.abort_request("unknown")
    assert sched.queues.used_blocks() == 0
    assert step(sched, engine).entries == (PrefillChunk("b", 8),)
    assert list(sched.queues.states) == ["b"]


def test_a_prefix_counted_cached_is_not_fed_but_its_blocks_are_claimed(new_request):
    """a starts from 8 cached tokens: its prefill feeds the last 4, and attaching the cached
    8 takes their 2 blocks from the 6 free, so b (13 tokens and a decode: 4 blocks) waits."""
    sched = make(num_blocks=6)
    sched.add_request(new_request("a", 12, 2), 0.0, cached=8)
    sched.add_request(new_request("b", 13, 2), 0.0)
    assert sched.schedule(0.0).entries == (PrefillChunk("a", 4),)
    with pytest.raises(ValueError, match="'c' cannot start from 4 cached tokens"):
        sched.add_request(new_request("c", 4, 2), 0.0, cached=4)


def test_nothing_to_do_plans_nothing():
    assert make().schedule(0.0) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_num_batched_tokens", 0), ("max_num_seqs", True), ("spec_k", -1), ("spec_k", 1.5)],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        VllmConfig(**{field: value})


def test_requests_that_can_never_run_are_refused_without_side_effects(new_request):
    sched = make(num_blocks=4, max_num_batched_tokens=32)
    sched.add_request(new_request("a", 4, 4), 0.0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(new_request("long", 30, 4), 0.0)
    with pytest.raises(ValueError, match="KV blocks"):
        make(num_blocks=2).add_request(new_request("big", 8, 2), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request(new_request("a", 1, 1), 0.0)
    assert list(sched.queues.waiting) == ["a"]
    assert sched.queues.states["a"].request.prompt_len == 4


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_workloads_finish_exactly_within_memory(
    data, counting_engine, workload, random_workload, expected
):
    drawn = random_workload(data, 40)
    num_blocks = drawn.num_blocks
    sched = make(
        num_blocks,
        drawn.block_size,
        max_num_batched_tokens=data.draw(st.integers(drawn.longest, 2 * drawn.longest)),
        max_num_seqs=data.draw(st.integers(1, 8)),
        spec_k=data.draw(st.integers(0, 4), label="spec_k"),
    )
    engine = counting_engine(sched.queues.budget, accept=drawn.accept)
    requests = drawn.requests
    plans = workload(sched, engine, requests)
    assert engine.finished == {r.request_id: expected(r) for _, r in requests}
    assert engine.peak_blocks <= num_blocks
    assert all(p.num_tokens <= sched.config.max_num_batched_tokens for p in plans)
    assert not sched.queues.states
