"""The replica loop without Ray: plans in, tokens out, reports back, KV freed on abort."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from cluster import replica_core
from cluster.config import ClusterConfig
from cluster.messages import AlreadyHeld, StepReport, StreamItem
from cluster.replica_actor import build_engine
from cluster.replica_core import ReplicaCore
from replica.batch import BatchPlan, DecodeStep, PrefillChunk
from replica.engine import Engine
from replica.planner.adaserve import AdaServeConfig
from replica.request import SLO, Request, SamplingParams
from tests.cluster.conftest import greedy_reference

pytestmark = pytest.mark.timeout(60)

PROMPT = [17, 230, 45, 9, 300]


@pytest.fixture(scope="module")
def engine(target_dir: Path) -> Engine:
    return Engine.from_dirs(target_dir, num_blocks=64)


def req(rid: str, max_tokens: int = 8) -> Request:
    return Request(rid, PROMPT, SamplingParams(max_tokens=max_tokens), slo=SLO(1000, 100))


async def drain(core: ReplicaCore, rid: str) -> list[StreamItem]:
    return [item async for item in core.stream(rid)]


def test_one_prefill_plan_then_derived_decodes_finish_the_request(engine: Engine) -> None:
    reports: list[StepReport] = []

    async def run() -> list[StreamItem]:
        core = ReplicaCore(engine, 3, reports.append)
        core.start()
        core.add_request(req("a"), admitted=True)
        # A stale plan: an unknown request and more prompt than there is; both are fitted.
        core.set_plan(BatchPlan((PrefillChunk("a", 99), DecodeStep("ghost"))))
        items = await drain(core, "a")
        await core.stop()
        return items

    items = asyncio.run(run())
    tokens = [t for item in items for t in item.token_ids]
    assert tokens == greedy_reference(engine, "ref", PROMPT, 8)
    assert items[-1].finish_reason in ("length", "stop")
    assert all(len(i.times) == len(i.token_ids) for i in items)
    assert [r.seq for r in reports] == list(range(1, len(reports) + 1))
    assert reports[0].plan == BatchPlan((PrefillChunk("a", len(PROMPT)),))
    assert all(isinstance(e, DecodeStep) for r in reports[1:] for e in r.plan.entries)
    assert all(r.replica == 3 for r in reports)
    assert engine.num_free_blocks == engine.cache.num_blocks


def test_logprobs_reach_the_stream_and_stay_out_of_the_reports(engine: Engine) -> None:
    reports: list[StepReport] = []
    asking = Request("p", PROMPT, SamplingParams(max_tokens=6, logprobs=2), slo=SLO(1000, 100))

    async def run() -> list[StreamItem]:
        core = ReplicaCore(engine, 0, reports.append)
        core.start()
        core.add_request(asking, admitted=True)
        core.set_plan(BatchPlan((PrefillChunk("p", len(PROMPT)),)))
        items = await drain(core, "p")
        await core.stop()
        return items

    items = asyncio.run(run())
    assert all(len(i.logprobs) == len(i.token_ids) for i in items)
    assert sum(len(i.logprobs) for i in items) == 6
    assert all(len(lp.top) == 2 for i in items for lp in i.logprobs)
    assert not any(o.logprobs for r in reports for o in r.outcome.outcomes)


def test_abort_ends_the_stream_and_frees_kv(engine: Engine) -> None:
    reports: list[StepReport] = []

    async def run() -> list[StreamItem]:
        core = ReplicaCore(engine, 0, reports.append)
        core.start()
        core.add_request(req("b", max_tokens=500), admitted=False)
        core.set_plan(BatchPlan((PrefillChunk("b", len(PROMPT)),)))
        stream = core.stream("b")
        first = await anext(stream)
        snap = core.snapshot()
        assert [h.request.request_id for h in snap.requests] == ["b"]
        assert not snap.requests[0].admitted and snap.requests[0].num_computed >= len(PROMPT)
        core.abort("b")
        rest = [item async for item in stream]
        await core.stop()
        return [first, *rest]

    items = asyncio.run(run())
    assert items[-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.cache.num_blocks
    assert not engine.has_request("b")
    # The abort is reported as a step with no work, so the controller's mirror drops it too.
    last = reports[-1]
    assert last.plan.entries == () and last.seq == len(reports)
    assert [(o.request_id, o.finish_reason) for o in last.outcome.outcomes] == [("b", "abort")]


def test_the_guarantees_a_plan_changes_reach_the_snapshot_and_the_first_token(
    engine: Engine,
) -> None:
    """A plan names the requests its planner promoted or demoted: the snapshot a rebuilt
    mirror starts from holds the change, and the next item a promoted request streams says
    so, once (its client's verdict is admitted); ids the replica does not hold are ignored."""

    async def run() -> tuple[list[StreamItem], list[StreamItem], list[StreamItem], list[bool]]:
        core = ReplicaCore(engine, 0, lambda report: None)
        core.start()
        core.add_request(req("late", max_tokens=3), admitted=False)
        core.add_request(req("slow", max_tokens=3), admitted=True)
        core.set_plan(
            BatchPlan((PrefillChunk("late", len(PROMPT)),)),
            {"late": True, "slow": False, "ended": True},
        )
        grades = [h.admitted for h in core.snapshot().requests]
        promoted = await drain(core, "late")
        core.set_plan(BatchPlan((PrefillChunk("slow", len(PROMPT)),)))
        demoted = await drain(core, "slow")
        core.add_request(req("later", max_tokens=40), admitted=False)
        core.set_plan(BatchPlan((PrefillChunk("later", len(PROMPT)),)))
        stream = core.stream("later")
        later = [await anext(stream)]
        core.set_plan(BatchPlan(()), {"later": True})  # after its first token
        later += [item async for item in stream]
        await core.stop()
        return promoted, demoted, later, grades

    promoted, demoted, later, grades = asyncio.run(run())
    assert grades == [True, False]
    assert promoted[0].token_ids and promoted[0].promoted
    assert not any(i.promoted for i in promoted[1:])
    assert not any(i.promoted for i in demoted)
    assert [i.promoted for i in later].count(True) == 1 and not later[0].promoted


def test_closing_the_stream_aborts_the_request(engine: Engine) -> None:
    async def run() -> ReplicaCore:
        core = ReplicaCore(engine, 0, lambda report: None)
        core.start()
        core.add_request(req("c", max_tokens=500), admitted=True)
        core.set_plan(BatchPlan((PrefillChunk("c", len(PROMPT)),)))
        stream = core.stream("c")
        await anext(stream)
        await stream.aclose()
        for _ in range(200):
            if not core.snapshot().requests:
                break
            await asyncio.sleep(0.01)
        await core.stop()
        return core

    core = asyncio.run(run())
    assert not core.snapshot().requests
    assert engine.num_free_blocks == engine.cache.num_blocks


def test_bad_requests_are_refused_and_unknown_streams_are_lost(engine: Engine) -> None:
    async def run() -> list[StreamItem]:
        core = ReplicaCore(engine, 0, lambda report: None)
        long = Request("long", [1] * 5000, SamplingParams(max_tokens=2), slo=SLO(1000, 100))
        with pytest.raises(ValueError, match="context"):
            core.add_request(long, admitted=True)
        core.add_request(req("d"), admitted=True)
        with pytest.raises(ValueError, match="already held"):
            core.add_request(req("d"), admitted=True)
        assert [h.request.request_id for h in core.snapshot().requests] == ["d"]
        core.start()
        core.abort("d")
        items = await drain(core, "d")
        items += await drain(core, "never-added")
        await core.stop()
        return items

    items = asyncio.run(run())
    assert items[0].finish_reason == "abort"
    assert items[-1].lost


def test_snapshot_leaves_out_requests_whose_abort_is_pending(engine: Engine) -> None:
    core = ReplicaCore(engine, 0, lambda report: None)
    core.add_request(req("kept"), admitted=True)
    core.add_request(req("gone"), admitted=False)
    core.abort("gone")
    held = [h.request.request_id for h in core.snapshot().requests]
    assert held == ["kept"]
    assert core.snapshot().ended == ("gone",)
    core.abort("kept")
    assert core.snapshot().requests == ()
    for rid in ("kept", "gone"):
        if engine.has_request(rid):
            engine.abort(rid)


def test_snapshot_lists_the_requests_ended_lately(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """So a rebuilt mirror can tell an ended request from one whose hand-off is on its way."""
    monkeypatch.setattr(replica_core, "ENDED_MEMORY", 2)

    async def run() -> tuple[str, ...]:
        core = ReplicaCore(engine, 0, lambda report: None)
        core.start()
        for rid in ("e1", "e2", "e3"):
            core.add_request(req(rid, 2), admitted=True)
            core.set_plan(BatchPlan((PrefillChunk(rid, len(PROMPT)),)))
            await drain(core, rid)
        core.add_request(req("pending"), admitted=True)
        core.abort("pending")
        ended = core.snapshot().ended
        await core.stop()
        return ended

    assert asyncio.run(run()) == ("e2", "e3", "pending")


def test_a_prefill_plan_is_fitted_to_what_the_prefix_cache_left(target_dir: Path) -> None:
    """The controller plans the whole prompt; the replica starts the request from its cached
    prefix first, so the step run and reported prefills the rest only."""
    cached_engine = Engine.from_dirs(target_dir, num_blocks=64, prefix_caching=True)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    reports: list[StepReport] = []

    cached: list[int] = []

    async def run() -> list[list[int]]:
        core = ReplicaCore(cached_engine, 0, reports.append)
        core.start()
        outputs = []
        for rid, logprobs in (("first", None), ("second", None), ("third", 0)):
            sampling = SamplingParams(max_tokens=4, prompt_logprobs=logprobs)
            core.add_request(Request(rid, prompt, sampling, slo=SLO(1000, 100)), admitted=True)
            core.set_plan(BatchPlan((PrefillChunk(rid, len(prompt)),)))
            items = await drain(core, rid)
            outputs.append([t for item in items for t in item.token_ids])
            cached.append(next(i.cached_tokens for i in items if i.token_ids))
        await core.stop()
        return outputs

    first, second, third = asyncio.run(run())
    assert first == second == third
    prefills = [e for r in reports for e in r.plan.entries if isinstance(e, PrefillChunk)]
    assert prefills == [
        PrefillChunk("first", 40),
        PrefillChunk("second", 40 - 32),
        PrefillChunk("third", 40),  # prompt log-probabilities: the whole prompt is computed
    ]
    lookups = [(r.prefix_queries, r.prefix_hits) for r in reports if r.prefix_queries]
    assert lookups == [(40, 0), (40, 32)] and cached == [0, 32, 0]


def test_a_refused_plan_lets_go_of_the_prefixes_attached_for_it(target_dir: Path) -> None:
    """The controller plans the KV without knowing of attached prefixes: when the engine
    refuses the plan they were attached for, the blocks go back to the cache, and a plan
    that needs every block runs next."""
    cached_engine = Engine.from_dirs(target_dir, num_blocks=8, prefix_caching=True)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    slo = SLO(1000, 100)

    def add(core: ReplicaCore, rid: str, tokens: list[int]) -> None:
        core.add_request(Request(rid, tokens, SamplingParams(max_tokens=1), slo=slo), True)

    async def run() -> None:
        core = ReplicaCore(cached_engine, 0, lambda report: None)
        core.start()
        add(core, "first", prompt)
        core.set_plan(BatchPlan((PrefillChunk("first", len(prompt)),)))
        await drain(core, "first")
        add(core, "again", prompt)
        add(core, "big", [9] * 127)  # with its first token, all 8 blocks
        core.set_plan(BatchPlan((PrefillChunk("again", 40), PrefillChunk("big", 127))))
        await asyncio.sleep(0.2)  # refused: the rest of "again" and "big" do not fit together
        core.set_plan(BatchPlan((PrefillChunk("big", 127),)))
        items = await asyncio.wait_for(drain(core, "big"), 10)
        assert items[-1].finish_reason == "length"
        await core.stop()

    asyncio.run(run())


def test_a_request_preempted_then_refused_a_plan_counts_no_hit_of_its_own_blocks(
    target_dir: Path,
) -> None:
    """A request's lookups after its first find its own blocks (a preemption keeps them in
    the cache): a refused plan between must not make the next one count them as prefix-cache
    hits (they reached usage's cached_tokens, for prompts sharing nothing)."""
    cached_engine = Engine.from_dirs(target_dir, num_blocks=20, prefix_caching=True)
    prompt = [(7 * i) % 500 + 3 for i in range(200)]
    other = [(11 * i) % 500 + 5 for i in range(250)]
    slo = SLO(1000, 100)
    reports: list[StepReport] = []

    async def steps(count: int) -> None:
        while len(reports) < count:
            await asyncio.sleep(0.01)

    async def run() -> int:
        core = ReplicaCore(cached_engine, 0, reports.append)
        core.start()
        for rid, tokens in (("a", prompt), ("b", other)):
            core.add_request(Request(rid, tokens, SamplingParams(max_tokens=2), slo=slo), True)
        core.set_plan(BatchPlan((PrefillChunk("a", 96),)))
        await asyncio.wait_for(steps(1), 10)
        core.set_plan(BatchPlan((), preempt=("a",)))
        await asyncio.wait_for(steps(2), 10)
        core.set_plan(BatchPlan((PrefillChunk("a", 200), PrefillChunk("b", 250))))
        await asyncio.sleep(0.3)  # refused: both do not fit in 20 blocks
        core.set_plan(BatchPlan((PrefillChunk("a", 200),)))
        items = await asyncio.wait_for(drain(core, "a"), 10)
        core.abort("b")
        await core.stop()
        assert items[-1].finish_reason == "length"
        return next(item.cached_tokens for item in items if item.token_ids)

    assert asyncio.run(run()) == 0


def test_a_plan_refused_for_the_prefixes_attached_for_it_runs_without_them(
    target_dir: Path,
) -> None:
    """A cached prefix's blocks are free ones until a request attaches it. A plan the
    attached prefixes left short of blocks was refused, resent with no report between and
    refused again: after a replica died, the controller's picture of this cache differed
    from it, and the replica stalled for good. It runs without the prefixes now, which
    prefills the credited request from its start. (Here a plan made by hand credits a
    prefix and gives its blocks to another prefill too.)"""
    cached_engine = Engine.from_dirs(target_dir, num_blocks=20, prefix_caching=True)
    shared = [(7 * i) % 500 + 3 for i in range(160)]
    slo = SLO(1000, 100)
    reports: list[StepReport] = []

    def add(core: ReplicaCore, rid: str, tokens: list[int], max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens)
        core.add_request(Request(rid, tokens, sampling, slo=slo), admitted=False)

    async def run() -> list[PrefillChunk]:
        core = ReplicaCore(cached_engine, 0, reports.append)
        core.start()
        add(core, "first", shared, 1)
        core.set_plan(BatchPlan((PrefillChunk("first", 160),)))
        await asyncio.wait_for(drain(core, "first"), 10)  # its 10 blocks stay cached, free
        add(core, "big", [(11 * i) % 500 + 5 for i in range(200)], 4)
        core.set_plan(BatchPlan((PrefillChunk("big", 150),)))  # 10 blocks, 10 left
        while len(reports) < 2:
            await asyncio.sleep(0.01)
        add(core, "again", [*shared, 9, 9, 9, 9, 9], 1)
        # Credited its 160 cached tokens: 5 to prefill; "big" needs 3 more blocks.
        core.set_plan(BatchPlan((PrefillChunk("again", 5), PrefillChunk("big", 50))))
        while len(reports) < 3:
            await asyncio.sleep(0.01)
        core.abort("again")
        core.abort("big")
        await core.stop()
        return [e for e in reports[2].plan.entries if isinstance(e, PrefillChunk)]

    ran = asyncio.run(asyncio.wait_for(run(), 20))
    assert ran == [PrefillChunk("again", 5), PrefillChunk("big", 50)]
    assert reports[2].prefix_queries == 0  # run bare: nothing attached


def test_a_request_bound_here_keeps_its_cached_prefix_from_being_taken_first(
    target_dir: Path,
) -> None:
    """ "first" and then "second" ran and left two cached blocks each, first's the least
    recently released. "again", bound here to start from first's prompt, touches them when
    it arrives: "big", which needs two of the four cached blocks, takes second's, and
    "again" finds its prefix when its prefill comes."""
    cached_engine = Engine.from_dirs(target_dir, num_blocks=8, prefix_caching=True)
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    slo = SLO(1000, 100)
    found: list[int] = []

    async def served(core: ReplicaCore, rid: str, tokens: list[int]) -> None:
        core.add_request(Request(rid, tokens, SamplingParams(max_tokens=1), slo=slo), True)
        core.set_plan(BatchPlan((PrefillChunk(rid, len(tokens)),)))
        items = await asyncio.wait_for(drain(core, rid), 10)
        found.append(next(i.cached_tokens for i in items if i.token_ids))

    async def run() -> None:
        core = ReplicaCore(cached_engine, 0, lambda report: None)
        core.start()
        await served(core, "first", prompt)
        await served(core, "second", [p + 1 for p in prompt])
        core.add_request(Request("again", prompt, SamplingParams(max_tokens=1), slo=slo), True)
        await asyncio.sleep(0.1)  # the replica's loop turns once: "again" waits, touched
        await served(core, "big", [9] * 80)  # 6 blocks: the 4 free and 2 cached ones
        core.set_plan(BatchPlan((PrefillChunk("again", len(prompt)),)))
        items = await asyncio.wait_for(drain(core, "again"), 10)
        found.append(next(i.cached_tokens for i in items if i.token_ids))
        await core.stop()

    asyncio.run(run())
    assert found == [0, 0, 0, 32]


def test_a_replica_builds_the_adaserve_trees_its_config_asks_for(
    target_dir: Path, draft_dir: Path
) -> None:
    config = ClusterConfig(
        model=str(target_dir),
        draft=str(draft_dir),
        spec_policy="adaserve",
        adaserve=AdaServeConfig(max_width=6, max_nodes=24),
        num_kv_blocks=16,
    )
    trees = build_engine(config).adaserve
    assert trees is not None and trees.config == AdaServeConfig(max_width=6, max_nodes=24)
    default = build_engine(dataclasses.replace(config, adaserve=None)).adaserve
    assert default is not None and default.config == AdaServeConfig()


def test_a_request_aborted_before_its_stream_is_opened_leaves_nothing(engine: Engine) -> None:
    """Its client left while the front door bound it: no one reads its stream, which must not
    stay (a few KB each, for the replica's life, and open work to a drain); one being read
    keeps its end for its reader."""

    async def run() -> tuple[tuple[int, int], list[StreamItem]]:
        core = ReplicaCore(engine, 0, lambda report: None)
        core.start()
        for i in range(3):
            core.add_request(req(f"gone-{i}", 64), admitted=True)
        core.add_request(req("read", 64), admitted=True)
        reader = asyncio.ensure_future(drain(core, "read"))
        await asyncio.sleep(0)
        for rid in ("gone-0", "gone-1", "gone-2", "read"):
            core.abort(rid)
        items = await asyncio.wait_for(reader, 20)
        work = core.open_work()
        await core.stop()
        return work, items

    work, items = asyncio.run(run())
    assert work == (0, 0)
    assert items[-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.cache.num_blocks


def test_a_stream_let_go_still_ends_as_aborted_for_a_late_reader(engine: Engine) -> None:
    """Let go unread (aborted before it was opened, or ended before its abort came): a reader
    opening it after gets its abort, not a lost stream it would resume on another replica,
    and the id is not taken again; an ended stream someone reads keeps its end."""

    async def run() -> None:
        core = ReplicaCore(engine, 0, lambda report: None)
        core.start()
        core.add_request(req("gone", 64), admitted=True)
        core.add_request(req("done", 2), admitted=True)
        core.add_request(req("kept", 2), admitted=True)
        core.abort("gone")
        core.set_plan(BatchPlan(tuple(PrefillChunk(r, len(PROMPT)) for r in ("done", "kept"))))
        while core.open_work()[0]:  # every one ended: "gone" aborted, the others finished
            await asyncio.sleep(0.01)
        core.abort("done")  # the door's abort, after it finished unread
        assert core.open_work() == (0, 1)  # "kept", unread yet
        for rid in ("gone", "done"):
            assert [i.finish_reason for i in await drain(core, rid)] == ["abort"]
            with pytest.raises(AlreadyHeld):
                core.add_request(req(rid), admitted=True)
        kept = await drain(core, "kept")
        assert kept[-1].finish_reason in ("length", "stop") and core.open_work() == (0, 0)
        assert [i.lost for i in await drain(core, "never")] == [True]
        await core.stop()

    asyncio.run(run())


def test_a_released_request_ends_its_stream_as_lost_read_or_not(engine: Engine) -> None:
    """The controller binds it elsewhere: its reader is told to resume it there (not that it
    ended), also one that opens the stream only after; its KV is freed and the mirror told."""
    reports: list[StepReport] = []

    async def run() -> tuple[list[StreamItem], list[StreamItem], tuple[int, int]]:
        core = ReplicaCore(engine, 0, reports.append)
        core.start()
        core.add_request(req("read", 500), admitted=False)
        core.add_request(req("unopened", 500), admitted=False)
        reader = asyncio.ensure_future(drain(core, "read"))
        await asyncio.sleep(0)
        core.abort("read", release=True)
        core.abort("unopened", release=True)
        items = await asyncio.wait_for(reader, 20)
        late = await asyncio.wait_for(drain(core, "unopened"), 20)
        work = core.open_work()
        await core.stop()
        return items, late, work

    items, late, work = asyncio.run(run())
    assert items[-1].lost and items[-1].finish_reason is None
    assert late == [StreamItem(lost=True)] and work == (0, 0)
    assert engine.num_free_blocks == engine.cache.num_blocks
    ended = {o.request_id: o.finish_reason for r in reports for o in r.outcome.outcomes}
    assert ended == {"read": "abort", "unopened": "abort"}
