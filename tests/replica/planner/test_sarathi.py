"""The decode-first chunked-prefill baseline on a token-count engine (fixtures in conftest.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.batch import DecodeStep, PrefillChunk
from replica.planner.base import CacheBudget
from replica.planner.sarathi import SarathiConfig, SarathiScheduler


def make(num_blocks: int = 64, block_size: int = 4, **config: int) -> SarathiScheduler:
    return SarathiScheduler(CacheBudget(num_blocks, block_size), SarathiConfig(**config))


def test_long_prompt_is_chunked_to_the_token_budget(counting_engine, add, step, new_request):
    sched = make(token_budget=8)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 20, 2))
    chunks = [step(sched, engine).entries for _ in range(4)]
    assert chunks == [
        (PrefillChunk("a", 8),),
        (PrefillChunk("a", 8),),
        (PrefillChunk("a", 4),),
        (DecodeStep("a"),),
    ]


def test_decodes_go_first_and_prefill_chunks_fill_the_rest(counting_engine, add, step, new_request):
    sched = make(token_budget=8)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 4, 10), new_request("b", 4, 10))
    assert step(sched, engine).entries == (PrefillChunk("a", 4), PrefillChunk("b", 4))
    add(sched, engine, new_request("c", 20, 2))
    assert [step(sched, engine).entries for _ in range(4)] == [
        (DecodeStep("a"), DecodeStep("b"), PrefillChunk("c", 6)),
        (DecodeStep("a"), DecodeStep("b"), PrefillChunk("c", 6)),
        (DecodeStep("a"), DecodeStep("b"), PrefillChunk("c", 6)),
        (DecodeStep("a"), DecodeStep("b"), PrefillChunk("c", 2)),
    ]
    assert step(sched, engine).entries == tuple(DecodeStep(rid) for rid in "abc")


def test_waiting_requests_are_admitted_fcfs_after_running_prefills(
    counting_engine, add, step, new_request
):
    sched = make(token_budget=10)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, *(new_request(rid, 6, 3) for rid in "abc"))
    assert step(sched, engine).entries == (PrefillChunk("a", 6), PrefillChunk("b", 4))
    assert step(sched, engine).entries == (
        DecodeStep("a"),
        PrefillChunk("b", 2),
        PrefillChunk("c", 6),
    )


def test_speculative_decodes_take_their_slots_from_the_budget(
    counting_engine, add, step, new_request, expected
):
    sched = make(token_budget=8, spec_k=2)
    engine = counting_engine(sched.queues.budget, accept=lambda _rid, _k: 0)
    add(sched, engine, new_request("a", 4, 3))
    step(sched, engine)
    add(sched, engine, new_request("b", 20, 2))
    assert step(sched, engine).entries == (DecodeStep("a", 1), PrefillChunk("b", 6))
    # One token left for a: it decodes without drafts.
    assert step(sched, engine).entries == (DecodeStep("a"), PrefillChunk("b", 7))
    assert engine.finished == {"a": expected(new_request("a", 4, 3))}


def test_a_chunk_short_of_memory_shrinks_to_the_free_slots(
    counting_engine, workload, new_request, expected
):
    sched = make(num_blocks=4, token_budget=4)
    engine = counting_engine(sched.queues.budget)
    a, b = new_request("a", 4, 6), new_request("b", 5, 2)
    plans = workload(sched, engine, [(0, a), (4, b)])
    assert plans[4].entries == (DecodeStep("a"), PrefillChunk("b", 3))
    # a's ninth slot takes the last free block: b fills only the free slot of its own block.
    assert plans[5].entries == (DecodeStep("a"), PrefillChunk("b", 1))
    assert plans[6].entries == (PrefillChunk("b", 1),)
    assert engine.finished == {"a": expected(a), "b": expected(b)}


def test_preempted_request_resumes_by_chunks_ahead_of_later_arrivals(
    counting_engine, workload, new_request, expected
):
    sched = make(num_blocks=4, token_budget=5)
    engine = counting_engine(sched.queues.budget)
    a, b, c = new_request("a", 6, 7), new_request("b", 1, 3), new_request("c", 6, 3)
    plans = workload(sched, engine, [(0, a), (2, b), (1, c)])
    assert plans[3].entries == (DecodeStep("a"), DecodeStep("c"))
    # a's next slot needs a block: c, the newest, gives way, and b may not take its place.
    assert plans[4].preempt == ("c",)
    assert plans[4].entries == (DecodeStep("a"),)
    resumed = [p.entries for p in plans if any(e.request_id == "c" for e in p.entries)][-2:]
    assert resumed == [
        (PrefillChunk("c", 5),),
        (PrefillChunk("c", 3), PrefillChunk("b", 1)),
    ]
    assert engine.finished == {"a": expected(a), "b": expected(b), "c": expected(c)}
    assert engine.peak_blocks <= 4


def test_abort_frees_blocks_for_the_next_plan(counting_engine, add, step, new_request):
    sched = make(num_blocks=4, token_budget=4)
    engine = counting_engine(sched.queues.budget)
    add(sched, engine, new_request("a", 8, 4), new_request("b", 8, 4))
    assert step(sched, engine).entries == (PrefillChunk("a", 4),)
    assert step(sched, engine).entries == (PrefillChunk("a", 4),)
    sched.abort_request("a")
    engine.abort("a")
    assert sched.queues.used_blocks() == 0
    assert step(sched, engine).entries == (PrefillChunk("b", 4),)


def test_nothing_to_do_plans_nothing():
    assert make().schedule(0.0) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("token_budget", 0), ("max_num_seqs", -3), ("spec_k", -1), ("token_budget", "8")],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SarathiConfig(**{field: value})


def test_a_request_larger_than_the_cache_is_refused(new_request):
    sched = make(num_blocks=2)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(new_request("big", 8, 2), 0.0)
    assert not sched.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_workloads_finish_exactly_within_memory(
    data, counting_engine, workload, random_workload, expected
):
    drawn = random_workload(data, 60)
    num_blocks = drawn.num_blocks
    sched = make(
        num_blocks,
        drawn.block_size,
        token_budget=data.draw(st.integers(1, 64), label="token_budget"),
        max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"),
        spec_k=data.draw(st.integers(0, 4), label="spec_k"),
    )
    engine = counting_engine(sched.queues.budget, accept=drawn.accept)
    requests = drawn.requests
    plans = workload(sched, engine, requests)
    assert engine.finished == {r.request_id: expected(r) for _, r in requests}
    assert engine.peak_blocks <= num_blocks
    assert all(p.num_tokens <= sched.config.token_budget for p in plans)
    assert not sched.queues.states
