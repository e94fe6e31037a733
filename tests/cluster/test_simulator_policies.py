"""Simulator policies beyond the basics: speculation, distserve, the slos ablations."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace

import pytest

from cluster.api import Verdict
from cluster.sim_distserve import KvLink, pool_splits
from cluster.sim_spec import SeededAcceptance, SimulatedTrees
from cluster.simulator import Policy, SimConfig, SimOutcome, SimRequest, SimResult, Simulator
from loadgen import simulate
from loadgen.arrivals import poisson_arrivals
from loadgen.workloads import WorkloadConfig, generate_workload, zero_load_ttft_from
from replica.perf_model import PerfModel
from replica.planner.adaserve import AdaServeConfig
from replica.planner.config import (
    GoodspeedConfig,
    LapsConfig,
    OutputEstimateConfig,
    PlannerConfig,
)
from replica.planner.slos import SlosScheduler
from replica.profiles import resolve_profile
from replica.request import SLO, Request, SamplingParams

LINEAR = PerfModel.synthetic({"const": 0.01, "tokens": 0.001})
"""A step takes 10 ms + 1 ms per query token; drafting is free."""
ROOMY = SLO(1000.0, 100.0)
IMPOSSIBLE = SLO(ttft_ms=1.0, tpot_ms=100.0)
A100 = PerfModel.load(resolve_profile("a100-40gb-opt-7b-tp1"))


def sim_request(
    rid: str, prompt: int, arrival: float, output_len: int, slo: SLO = ROOMY
) -> SimRequest:
    request = Request(rid, [0] * prompt, SamplingParams(max_tokens=64), slo)
    request.arrival_time = arrival
    return SimRequest(request, output_len)


@dataclass
class Ran:
    """A finished simulation and its result."""

    sim: Simulator
    result: SimResult


def run(requests: list[SimRequest], config: SimConfig, perf: PerfModel = LINEAR) -> Ran:
    sim = Simulator(perf, requests, config)
    return Ran(sim, sim.run())


def outcomes(ran: Ran) -> tuple[SimOutcome, ...]:
    return ran.result.outcomes


def times(ran: Ran) -> dict[str, tuple[float, ...]]:
    return {o.request_id: o.token_times_s for o in outcomes(ran)}


def test_slos_speculates_four_tokens_when_every_draft_is_accepted() -> None:
    # Admitted on arrival at 0.0, prefill 0.0-0.02 (10 + 10 tokens ms). With a loose TPOT the
    # longest speculation (4) gives the most prefill budget, so each verify feeds 5 tokens
    # (15 ms) and, at alpha 1, yields 5: tokens 1-5 at 0.035, 6-10 at 0.05.
    ran = run([sim_request("a", 10, 0.0, 11)], SimConfig(acceptance=1.0))
    assert times(ran)["a"] == pytest.approx((0.02, *[0.035] * 5, *[0.05] * 5))
    assert ran.sim.replicas[0].executor.drafted == [4, 4]


def test_the_planner_starts_from_the_engines_alpha_and_never_drafts_at_zero() -> None:
    config = SimConfig(acceptance=0.0)
    spec = config.planner_config().spec
    assert spec is not None and spec.initial_acceptance == 0.0
    ran = run([sim_request("a", 10, 0.0, 3)], config)
    assert times(ran)["a"] == pytest.approx((0.02, 0.031, 0.042))
    assert ran.sim.replicas[0].executor.drafted == [0, 0]


def chatbot(n: int, rate: float, seed: int) -> list[SimRequest]:
    config = WorkloadConfig(zero_load_ttft_from(A100))
    workload = generate_workload("chatbot", poisson_arrivals(rate, n, seed), config, seed)
    return simulate.sim_requests(workload)


def test_speculation_is_deterministic_for_a_seed_and_depends_on_it() -> None:
    def seeded(seed: int) -> tuple[SimOutcome, ...]:
        config = SimConfig(num_kv_blocks=2048, seed=seed)
        ran = run(chatbot(30, 4.0, 0), config, A100)
        assert any(k > 0 for k in ran.sim.replicas[0].executor.drafted)
        return outcomes(ran)

    first = seeded(1)
    assert first == seeded(1)
    assert first != seeded(2)


def test_acceptance_streams_are_per_request() -> None:
    alone = SeededAcceptance(0.5, 3)
    first = [alone("a", 4) for _ in range(20)]
    mixed = SeededAcceptance(0.5, 3)
    interleaved = []
    for _ in range(20):
        mixed("b", 4)
        interleaved.append(mixed("a", 4))
    assert first == interleaved and 0 < sum(first) < 80
    with pytest.raises(ValueError, match="acceptance"):
        SeededAcceptance(1.5, 0)
    with pytest.raises(ValueError, match="acceptance_spread"):
        SeededAcceptance(0.5, 0, -0.1)


def test_a_spread_gives_each_request_its_own_acceptance() -> None:
    spread = SeededAcceptance(0.5, 3, 0.3)
    alphas = [spread.alpha_of(f"r{i}") for i in range(200)]
    assert all(0.2 <= a <= 0.8 for a in alphas) and min(alphas) < 0.3 and max(alphas) > 0.7
    assert spread.alpha_of("r7") == SeededAcceptance(0.5, 3, 0.3).alpha_of("r7")
    # A request's verifies follow its own alpha: the most and least likely accept differently.
    best, worst = max(range(200), key=alphas.__getitem__), min(range(200), key=alphas.__getitem__)
    assert sum(spread(f"r{best}", 1) for _ in range(400)) > sum(
        spread(f"r{worst}", 1) for _ in range(400)
    )
    # No spread: every request at alpha, with the streams runs had before spreads existed.
    plain = SeededAcceptance(0.5, 3)
    assert plain.alpha_of("a") == 0.5
    rng = random.Random("3:a")
    assert [plain("a", 1) for _ in range(30)] == [int(rng.random() < 0.5) for _ in range(30)]


def test_goodspeed_policy_plans_with_goodspeed_and_serves_every_token() -> None:
    config = SimConfig(policy=Policy.SLOS_GOODSPEED, acceptance_spread=0.3)
    assert config.planner_config().goodspeed == GoodspeedConfig()
    assert SimConfig().planner_config().goodspeed is None
    nospec = SimConfig(policy=Policy.SLOS_NOSPEC, planner=config.planner_config())
    assert nospec.planner_config().goodspeed is None and nospec.planner_config().spec is None
    requests = chatbot(40, 4.0, 0)
    got = times(run(requests, config, A100))
    assert [len(got[r.request.request_id]) for r in requests] == [r.output_len for r in requests]
    plain = times(run(requests, replace(config, policy=Policy.SLOS), A100))
    assert got != plain, "the drafts moved, so some tokens came out at other times"


def test_confidences_keep_each_requests_acceptance_and_its_stream() -> None:
    """Drawn confidences average the request's alpha and are accepted at their own value, so
    each draft is still accepted with probability alpha; a policy that ignores them verifies
    from the same per-request streams."""
    sure = SeededAcceptance(0.6, 3, concentration=2.0)
    draws = [sure.draws(f"r{i}", 8) for i in range(300)]
    confidences = [c for cs, _ in draws for c in cs]
    assert 0.57 < sum(confidences) / len(confidences) < 0.63
    accepted = [ok for _, oks in draws for ok in oks]
    assert 0.57 < sum(accepted) / len(accepted) < 0.63
    low = [ok for cs, oks in draws for c, ok in zip(cs, oks, strict=True) if c < 0.3]
    high = [ok for cs, oks in draws for c, ok in zip(cs, oks, strict=True) if c > 0.9]
    assert sum(low) / len(low) < 0.2 < 0.9 < sum(high) / len(high)
    again = SeededAcceptance(0.6, 3, concentration=2.0)
    _, first = again.draws("r0", 8)
    assert SeededAcceptance(0.6, 3, concentration=2.0)("r0", 8) == sum(
        1 for _ in itertools.takewhile(bool, first)
    )
    with pytest.raises(ValueError, match="need a confidence_concentration"):
        SeededAcceptance(0.6, 3).draws("r0", 2)
    with pytest.raises(ValueError, match="confidence_concentration"):
        SeededAcceptance(0.6, 3, concentration=0.0)


def _against_slos(config: SimConfig) -> tuple[Ran, Ran]:
    """A speculation policy that plans as slos does, run on a chatbot burst: every token
    served, the same run for the same seed; and slos's run beside it."""
    assert config.planner_config() == replace(config, policy=Policy.SLOS).planner_config()
    requests = chatbot(40, 4.0, 0)
    ran = run(requests, config, A100)
    got = times(ran)
    assert [len(got[r.request.request_id]) for r in requests] == [r.output_len for r in requests]
    assert times(run(requests, config, A100)) == got, "deterministic for a seed"
    return ran, run(requests, replace(config, policy=Policy.SLOS), A100)


def test_specserve_policy_needs_confidences_and_verifies_fewer_drafts() -> None:
    with pytest.raises(ValueError, match="set confidence_concentration"):
        SimConfig(policy=Policy.SLOS_SPECSERVE)
    config = SimConfig(policy=Policy.SLOS_SPECSERVE, confidence_concentration=1.0)
    specserve, plain = _against_slos(config)
    runs = {"specserve": specserve.result, "slos": plain.result}
    verified = {name: r.verified_drafts / r.decode_steps for name, r in runs.items()}
    assert verified["specserve"] < verified["slos"]
    accepted = {name: r.accepted_drafts / r.verified_drafts for name, r in runs.items()}
    assert accepted["specserve"] > accepted["slos"], "the drafts dropped were the unlikely ones"


def test_simulated_trees_accept_later_choices_as_the_siblings_say() -> None:
    """p_0 = alpha, p_1 = s_1 (1 - alpha), p_2 = s_2 (1 - p_0 - p_1); the beam keeps the
    children of highest path chance; a walk accepts a path with its chance."""
    trees = SimulatedTrees(SeededAcceptance(0.6, 3), (0.5, 0.25))
    assert trees.chances("r", 4) == pytest.approx([0.6, 0.2, 0.05, 0.0375])
    tree = trees.candidate("r", depth=2, width=2)
    # Level 1: ranks 0 (0.6) and 1 (0.2); level 2: 0.6 x 0.6 and 0.6 x 0.2 beat 0.2 x 0.6.
    assert tree.parents == [-1, 0, 0, 1, 1] and tree.tokens == [0, 0, 1, 0, 1]
    assert tree.probs == pytest.approx([1.0, 0.6, 0.2, 0.36, 0.12])
    accepted = [len(trees.walk(f"w{i}", tree)) for i in range(4000)]
    expected = sum(tree.probs[1:])  # E[accepted] = sum of f over the nodes below the root
    assert abs(sum(accepted) / len(accepted) - expected) < 0.04

    def walks(rid: str) -> list[list[int]]:
        fresh = SimulatedTrees(SeededAcceptance(0.6, 3), (0.5, 0.25))
        return [fresh.walk(rid, tree) for _ in range(20)]

    assert walks("a") == walks("a") != walks("b"), "per-request seeded streams"
    with pytest.raises(ValueError, match="sibling_acceptance"):
        SimulatedTrees(SeededAcceptance(0.6, 3), (1.5,))
    with pytest.raises(ValueError, match="at least one"):
        SimulatedTrees(SeededAcceptance(0.6, 3), ())


def test_adaserve_policy_serves_every_token_and_verifies_trees() -> None:
    config = SimConfig(policy=Policy.SLOS_ADASERVE, sibling_acceptance=(0.9, 0.9))
    trees, plain = _against_slos(config)
    runs = {"trees": trees.result, "chains": plain.result}
    accepted = {name: r.accepted_drafts / r.decode_steps for name, r in runs.items()}
    assert accepted["trees"] > accepted["chains"], "likely siblings add accepted tokens"
    with pytest.raises(ValueError, match="sibling_acceptance"):
        SimConfig(policy=Policy.SLOS_ADASERVE, sibling_acceptance=(-0.1,))
    # Trees one child wide are chains: the likely siblings go untried.
    chains = _against_slos(replace(config, adaserve=AdaServeConfig(max_width=1)))[0].result
    assert chains.accepted_drafts / chains.decode_steps < accepted["trees"]


def test_distserve_reproduces_a_hand_computed_schedule_with_a_queued_kv_link() -> None:
    # Prefill replica 0: A 0-0.02 (10 tokens), B 0.02-0.05 (20 tokens). Link at 4 MB/token,
    # 1 GB/s: A's KV 0.02-0.06, B's waits for the link, 0.06-0.14. Decode replica 1: A's
    # decodes (11 ms) end 0.071, 0.082; B's at 0.151.
    requests = [sim_request("a", 10, 0.0, 3), sim_request("b", 20, 0.005, 2)]
    config = SimConfig(
        policy=Policy.DISTSERVE, replicas=2, kv_link_gb_s=1.0, kv_bytes_per_token=4e6
    )
    ran = run(requests, config)
    got = times(ran)
    assert got["a"] == pytest.approx((0.02, 0.071, 0.082))
    assert got["b"] == pytest.approx((0.05, 0.151))
    assert {o.replica for o in outcomes(ran)} == {1}


def test_kv_link_and_pool_splits() -> None:
    link = KvLink(gb_s=2.0, bytes_per_token=1e6)
    assert link.send(1.0, 100) == pytest.approx(1.05)
    assert link.send(1.01, 100) == pytest.approx(1.10)
    assert link.send(2.0, 10) == pytest.approx(2.005)
    assert pool_splits(2) == [(1, 1)]
    assert pool_splits(4) == [(2, 2), (3, 1), (1, 3)]
    with pytest.raises(ValueError, match="replicas"):
        pool_splits(1)
    with pytest.raises(ValueError, match="prefill_replicas"):
        SimConfig(policy=Policy.DISTSERVE, replicas=2, prefill_replicas=2)
    with pytest.raises(ValueError, match="kv_link_gb_s"):
        KvLink(gb_s=0.0, bytes_per_token=1.0)


def test_distserve_finishes_a_chatbot_burst_with_every_token() -> None:
    requests = chatbot(40, 8.0, 2)
    config = SimConfig(policy=Policy.DISTSERVE, replicas=3, prefill_replicas=1)
    ran = run(requests, config, A100)
    done = outcomes(ran)
    assert [len(o.token_times_s) for o in done] == [r.output_len for r in requests]
    assert {o.replica for o in done} <= {1, 2}


def test_noadmit_admits_what_slos_declines() -> None:
    requests = [sim_request("a", 10, 0.0, 3, IMPOSSIBLE), sim_request("b", 10, 0.5, 3)]
    slos = outcomes(run(requests, SimConfig()))
    noadmit = outcomes(run(requests, SimConfig(policy=Policy.SLOS_NOADMIT)))
    assert [o.verdict for o in slos] == [Verdict.BEST_EFFORT, Verdict.ADMITTED]
    assert [o.verdict for o in noadmit] == [Verdict.ADMITTED, Verdict.ADMITTED]


def test_noadmit_waits_for_memory_in_arrival_order() -> None:
    # Each request reserves prompt + max_tokens - 1 = 73 slots = 5 blocks; 8 blocks hold one.
    requests = [sim_request("a", 10, 0.0, 3), sim_request("b", 10, 0.0, 3)]
    config = SimConfig(policy=Policy.SLOS_NOADMIT, num_kv_blocks=8)
    got = times(run(requests, config))
    assert got["b"][0] > got["a"][-1]


def test_noroute_sends_a_declined_request_to_the_backup_at_once() -> None:
    requests = [sim_request("a", 10, 0.0, 3, IMPOSSIBLE)]
    routed = outcomes(run(requests, SimConfig(replicas=2)))
    config = SimConfig(policy=Policy.SLOS_NOROUTE, replicas=2, route_limit=2)
    alone = outcomes(run(requests, config))
    assert routed[0].hops == 2 and alone[0].hops == 1
    assert routed[0].verdict is alone[0].verdict is Verdict.BEST_EFFORT


def test_nospec_never_drafts() -> None:
    ran = run(chatbot(20, 4.0, 0), SimConfig(policy=Policy.SLOS_NOSPEC), A100)
    assert ran.sim.config.planner_config().spec is None
    assert not any(ran.sim.replicas[0].executor.drafted)


def test_laps_serves_short_best_effort_requests_before_a_long_one() -> None:
    # Every request is declined and served best-effort, one per batch, and is late for
    # every token (so none goes first as still on time): oldest first the long one finishes
    # before the short ones that arrive just after it; slos+laps moves it down a level once
    # it has had 20 ms of service.
    hopeless = SLO(ttft_ms=1.0, tpot_ms=0.01)
    requests = [sim_request("long", 10, 0.0, 40, hopeless)] + [
        sim_request(f"s{i}", 10, 0.001, 3, hopeless) for i in range(3)
    ]
    planner = PlannerConfig(max_best_effort_requests=1)
    fcfs = times(run(requests, SimConfig(policy=Policy.SLOS, planner=planner)))
    laps = LapsConfig(first_level_s=0.02, window=1000)
    config = SimConfig(
        policy=Policy.SLOS_LAPS, planner=PlannerConfig(max_best_effort_requests=1, laps=laps)
    )
    assert config.planner_config().laps == laps
    assert SimConfig(policy=Policy.SLOS_LAPS).planner_config().laps == LapsConfig()
    assert SimConfig().planner_config().laps is None
    got = times(run(requests, config))
    assert all(fcfs[f"s{i}"][-1] > fcfs["long"][-1] for i in range(3))
    assert all(got[f"s{i}"][-1] < got["long"][-1] for i in range(3))
    assert sum(t[-1] for t in got.values()) < sum(t[-1] for t in fcfs.values())


def two_growing(warm_output: int, output: int, blocks: int) -> tuple[Ran, SlosScheduler]:
    """A warm-up request teaches the replica its output length (the reservation step); then
    A and B arrive together and grow to `output` tokens in `blocks` KV blocks."""
    planner = PlannerConfig(output_estimate=OutputEstimateConfig(quantile=0.5, min_samples=1))
    requests = [
        sim_request("warm", 16, 0.0, warm_output),
        sim_request("a", 16, 1.0, output),
        sim_request("b", 16, 1.0, output),
    ]
    config = SimConfig(policy=Policy.SLOS_NOSPEC, num_kv_blocks=blocks, planner=planner)
    ran = run(requests, config)
    mirror = ran.sim.replicas[0].mirror
    assert mirror is not None and isinstance(mirror.scheduler, SlosScheduler)
    assert [len(t) for t in times(ran).values()] == [warm_output, output, output]
    return ran, mirror.scheduler


def test_outgrown_reservations_demote_the_newest_admitted_request() -> None:
    # Outputs are taught to be 2 tokens long, so A and B reserve 16 + 2 - 1 slots (2 blocks)
    # each; both run to 60 tokens (76 slots, 5 blocks), which two cannot do in 8 blocks: B,
    # the newer, loses its guarantee (and its memory while A needs it), and both still
    # finish every token.
    _, scheduler = two_growing(2, 60, 8)
    assert list(scheduler.demoted) == ["b"]


def test_outgrown_headroom_is_given_up_before_any_guarantee() -> None:
    # Outputs are taught to be 20 tokens, so A and B reserve 20 slots at a time: at 56 tokens
    # both ask for 75 (5 blocks), 10 of the 9 blocks. What each holds at its longest, 60
    # slots (4 blocks), fits: the newer one gives up its headroom instead of its guarantee.
    ran, scheduler = two_growing(20, 44, 9)
    assert not scheduler.demoted
    assert [o.verdict for o in outcomes(ran)] == [Verdict.ADMITTED] * 3
