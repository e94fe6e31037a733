"""Prefix caches in the simulator: a hand-computed hit, routing by them, shared token ids."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.api import Verdict
from cluster.simulator import Policy, SimConfig, SimRequest, Simulator
from loadgen import simulate
from loadgen.mixes import mix_from_dict
from loadgen.workloads import WorkloadConfig, generate_workload
from replica.perf_model import PerfModel
from replica.planner.executor import token_ids
from replica.request import SLO, Request, SamplingParams

LINEAR = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})
"""A step takes 10 ms + 1 ms per query token."""
ROOMY = SLO(5000.0, 500.0)


def sim_request(
    rid: str, prompt: list[int], arrival: float, follows: str | None = None
) -> SimRequest:
    request = Request(rid, prompt, SamplingParams(max_tokens=2), ROOMY, arrival_time=arrival)
    return SimRequest(request, 2, follows)


@pytest.mark.parametrize("policy", [Policy.VLLM, Policy.SLOS_NOSPEC])
def test_a_prefill_begins_after_the_prefix_its_replica_cached(policy: Policy) -> None:
    """A: 40 tokens, prefilled 0-0.05, a decode to 0.061. B, at 1.0, shares A's first 32:
    with the cache it prefills its last 8 (1.0-1.018), without it all 40 (1.0-1.05)."""
    shared = list(range(100, 132))
    requests = [
        sim_request("a", [*shared, *range(1, 9)], 0.0),
        sim_request("b", [*shared, *range(9, 17)], 1.0),
    ]
    cached = Simulator(LINEAR, requests, SimConfig(policy=policy, prefix_caching=True)).run()
    plain = Simulator(LINEAR, requests, SimConfig(policy=policy)).run()
    first = {o.request_id: o.token_times_s[0] for o in cached.outcomes}
    assert first["a"] == pytest.approx(0.05) and first["b"] == pytest.approx(1.018)
    assert [o.token_times_s[0] for o in plain.outcomes] == pytest.approx([0.05, 1.05])
    assert (cached.prefix_queries, cached.prefix_hits) == (80, 32)
    assert (plain.prefix_queries, plain.prefix_hits) == (0, 0)


@pytest.mark.parametrize("credit", [True, False])
def test_admission_counts_the_prefix_its_replica_computed_as_done(credit: bool) -> None:
    """A's 400 tokens prefill in 410 ms and it ends. B, at 1.0, shares A's first 384 and
    wants its first token within 100 ms: priced in full (410 ms) it cannot be promised and
    runs best-effort; counting the 384 cached tokens done (26 ms), it is admitted."""
    shared = list(range(1000, 1384))
    a = sim_request("a", [*shared, *range(1, 17)], 0.0)
    b = Request("b", [*shared, *range(17, 33)], SamplingParams(max_tokens=2), SLO(100.0, 500.0))
    requests = [a, SimRequest(replace(b, arrival_time=1.0), 2)]
    config = SimConfig(policy=Policy.SLOS_NOSPEC, prefix_caching=True, credit_prefixes=credit)
    result = Simulator(LINEAR, requests, config).run()
    outcome = {o.request_id: o for o in result.outcomes}
    assert outcome["b"].verdict is (Verdict.ADMITTED if credit else Verdict.BEST_EFFORT)
    assert outcome["b"].token_times_s[0] == pytest.approx(1.026)
    assert (result.credited_tokens, result.credit_missed_tokens) == ((384, 0) if credit else (0, 0))


def test_a_preempted_request_resumes_from_what_it_had_cached() -> None:
    """Six blocks of 16, prompts of 17: A and B decode to three blocks each, then vllm
    preempts B (48 tokens computed) so that A can grow. B's blocks stay cached, its output's
    too, and its resume computes what follows the first two (a resume leaves its last two
    tokens to feed): 17 tokens, not 49."""

    def run(caching: bool) -> tuple[dict[str, tuple[float, ...]], int]:
        requests = [
            SimRequest(
                Request(rid, list(range(base, base + 17)), SamplingParams(max_tokens=40), ROOMY),
                40,
            )
            for rid, base in (("a", 100), ("b", 200))
        ]
        config = SimConfig(policy=Policy.VLLM, num_kv_blocks=6, prefix_caching=caching)
        result = Simulator(LINEAR, requests, config).run()
        assert (result.preemptions, result.preempted_tokens) == (1, 48)
        return {o.request_id: o.token_times_s for o in result.outcomes}, result.prefix_hits

    (plain, _), (cached, hits) = run(False), run(True)
    assert hits == 32 and len(cached["b"]) == len(plain["b"]) == 40
    assert cached["b"][:32] == plain["b"][:32]
    # The resume: 49 known tokens prefilled again (59 ms), or 17 after the cached 32 (27 ms).
    assert cached["b"][32] == pytest.approx(plain["b"][32] - 0.032)


def test_slos_prefix_sends_each_round_where_the_round_before_ran() -> None:
    """Three sessions of three rounds over two replicas, each round's prompt its history:
    slos+prefix keeps a session on one replica, where round robin moves it."""
    mix = mix_from_dict(
        {
            "classes": [
                {
                    "name": "agent",
                    "share": 1,
                    "prompt": 64,
                    "output": 4,
                    "ttft": "loose",
                    "tpot": "loose",
                    "tools": {"calls": 2, "response": 20},
                }
            ]
        },
        "x",
    )
    workload = generate_workload(mix, [0.0, 0.3, 0.6], WorkloadConfig(lambda n: 0.5), seed=3)
    places = {}
    for policy in (Policy.SLOS, Policy.SLOS_PREFIX):
        config = SimConfig(policy=policy, replicas=2, prefix_caching=True)
        _, result, _ = simulate.simulate_workload(LINEAR, workload, config)
        sessions: dict[str, set[int | None]] = {}
        for o in result.outcomes:
            sessions.setdefault(o.request_id.rsplit(".", 1)[0], set()).add(o.replica)
        places[policy] = sorted(len(s) for s in sessions.values())
    assert places[Policy.SLOS_PREFIX] == [1, 1, 1]
    assert places[Policy.SLOS] != [1, 1, 1]


def test_shared_token_ids_say_what_live_prompts_share() -> None:
    classes = [
        {"name": "agent", "share": 1, "prompt": 60, "output": 5, "system_prompt": 20},
        {"name": "plain", "share": 1, "prompt": 60, "output": 5},
    ]
    for c in classes:
        c |= {"ttft": "loose", "tpot": "loose"}
    classes[0]["tools"] = {"calls": 1, "response": 8}
    workload = generate_workload(
        mix_from_dict({"classes": classes}, "x"), [0.0] * 6, WorkloadConfig(lambda n: 0.5), 1
    )
    plain = simulate.sim_requests(workload)
    assert all(set(r.request.prompt_token_ids) == {0} for r in plain)
    shared = {r.request.request_id: r for r in simulate.sim_requests(workload, True)}
    for w in workload:
        prompt = shared[w.request_id].request.prompt_token_ids
        assert len(prompt) == w.prompt_len
        if w.follows is not None:
            before = shared[w.follows]
            history = [
                *before.request.prompt_token_ids,
                *token_ids(w.follows, 0, before.output_len),
            ]
            assert prompt[: len(history)] == history
    starts = [w for w in workload if w.follows is None]
    firsts = [shared[w.request_id].request.prompt_token_ids for w in starts]
    agents = [shared[w.request_id].request.prompt_token_ids for w in starts if w.shared_prefix]
    assert agents and len({tuple(p[:20]) for p in agents}) == 1
    assert len({tuple(p[:16]) for p in firsts}) == len(firsts) - len(agents) + 1


def test_prefix_options_are_checked() -> None:
    with pytest.raises(ValueError, match="slos\\+prefix routes by the replicas' caches"):
        SimConfig(policy=Policy.SLOS_PREFIX)
    with pytest.raises(ValueError, match="distserve is simulated without prefix caching"):
        SimConfig(policy=Policy.DISTSERVE, replicas=2, prefix_caching=True)
