"""The seed papers' policies on a live cluster: GOODSPEED's draft split (or SpecServe's
confidence-cut drafts on the replica) and LAPS-SD's best-effort order run the real engine's
steps (tests/cluster/test_control.py checks the planner they configure), and the text stays
the model's own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest

from cluster.api import FinalRecord, Verdict
from cluster.config import ClusterConfig
from cluster.handle import ClusterHandle
from replica.engine import Engine
from replica.request import SLO, Request, SamplingParams, Tier
from tests.cluster.conftest import collect, greedy_reference, launched, write_profile

pytestmark = pytest.mark.timeout(180)

CHAT = SLO(ttft_ms=3000, tpot_ms=250)
LOOSE = SLO(ttft_ms=3000, tpot_ms=500)


@pytest.fixture(scope="module", params=["goodspeed", "specserve", "adaserve"])
def cluster(
    request: pytest.FixtureRequest,
    ray_session: None,
    runner: asyncio.Runner,
    demo: ClusterConfig,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterHandle]:
    """One replica whose profile makes drafts and tokens cheap, so its steps speculate (a
    verify token still costs 4 ms, enough for SpecServe to cut unlikely drafts)."""
    profile = write_profile(
        tmp_path_factory.mktemp("cheap-drafts") / "p.json", tokens=0.004, draft_steps=1e-3
    )
    config = replace(
        demo,
        profile=str(profile),
        num_kv_blocks=256,
        replicas=1,
        spec_policy=request.param,
        best_effort_order="laps",
    )
    yield from launched(runner, config)


def test_seed_policies_serve_the_models_own_text(
    cluster: ClusterHandle, runner: asyncio.Runner, engine: Engine
) -> None:
    # Admitted requests of two tiers speculate (different lengths GOODSPEED may re-split),
    # then best-effort requests run in LAPS-SD's order.
    prompts = {f"p{i}": [21 + i, 300 + 5 * i, 44, 120 + i, 7] for i in range(6)}
    slos = [CHAT, LOOSE, CHAT, LOOSE, None, None]
    requests = [
        Request(
            rid,
            prompt,
            SamplingParams(max_tokens=24),
            slo=slo,
            tier=Tier.SLO if slo is not None else Tier.BEST_EFFORT,
        )
        for (rid, prompt), slo in zip(prompts.items(), slos, strict=True)
    ]

    async def run(batch: list[Request]) -> list[tuple[list[int], FinalRecord]]:
        return await asyncio.gather(*(collect(cluster.submit(r)) for r in batch))

    served = runner.run(run(requests[:4])) + runner.run(run(requests[4:]))
    for request, (tokens, final) in zip(requests, served, strict=True):
        rid = request.request_id
        assert tokens == greedy_reference(engine, rid, prompts[rid], 24)
        want = Verdict.ADMITTED if request.slo is not None else Verdict.BEST_EFFORT
        assert final.verdict is want
    counters = runner.run(cluster.metrics_snapshot())["counters"]
    assert isinstance(counters, dict) and counters["spec_draft_tokens"] > 0
