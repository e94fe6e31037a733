"""Workloads: Table 4 length fits, Table 1 SLO levels, stages, tool rounds, hidden lengths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE, TraceRow
from loadgen.workloads import (
    STAGE_END_TOKEN,
    TABLE4,
    TOOL_CALLS,
    TRACE_FILES,
    LogNormalLengths,
    Scenario,
    SLOTargets,
    WorkloadConfig,
    WorkloadRequest,
    generate_workload,
    grow_rounds,
    table4_lengths,
    zero_load_decode_step_s,
    zero_load_ttft_from,
)
from replica.perf_model import PerfModel
from replica.request import SLO

PROFILE = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "a100-40gb-opt-7b-tp1.json"


def zero_load(prompt_len: int) -> float:
    return 0.01 + prompt_len * 1e-4


CONFIG = WorkloadConfig(zero_load_ttft_s=zero_load)


def arrivals(n: int) -> list[float]:
    return [0.1 * i for i in range(n)]


@pytest.mark.parametrize("key", sorted(TABLE4))
def test_fitted_lengths_match_table4_mean_and_p99(key: str) -> None:
    dist = table4_lengths(key)
    samples = dist.sample(np.random.default_rng(0), 200_000)
    stats = TABLE4[key]
    assert samples.min() >= 1 and samples.max() <= dist.cap
    assert samples.mean() == pytest.approx(stats.mean, rel=0.03)
    assert np.percentile(samples, 99) == pytest.approx(stats.p99, rel=0.03)
    assert dist.cap > stats.p99


def test_length_scale_scales_the_fit() -> None:
    full, tenth = table4_lengths("chatbot.prompt"), table4_lengths("chatbot.prompt", 0.1)
    assert tenth.sigma == pytest.approx(full.sigma)
    assert tenth.sample(np.random.default_rng(1), 100_000).mean() == pytest.approx(76.3, rel=0.03)


@pytest.mark.parametrize(("mean", "p99"), [(100, 100), (100, 50), (100, 2000), (0, 10), (10, 0)])
def test_impossible_lognormal_fits_raise(mean: float, p99: float) -> None:
    with pytest.raises(ValueError):
        LogNormalLengths(mean, p99)


def test_unknown_table4_entry_raises() -> None:
    with pytest.raises(ValueError, match="unknown Table 4 entry"):
        table4_lengths("chatbot.thinking")


@pytest.mark.parametrize(
    ("scenario", "ttft_slowdown", "tpot_ms"),
    [("chatbot", 5.0, 100.0), ("coder", 5.0, 50.0), ("summarizer", 3.0, 100.0)],
)
def test_simple_scenarios_follow_table1_levels(
    scenario: str, ttft_slowdown: float, tpot_ms: float
) -> None:
    reqs = generate_workload(scenario, arrivals(3000), CONFIG, seed=0)
    assert len(reqs) == 3000
    assert {r.max_tokens for r in reqs} == {table4_lengths(f"{scenario}.output").cap}
    for r in reqs[:50]:
        assert r.scenario == scenario and r.follows is None
        assert r.zero_load_ttft_s == pytest.approx(zero_load(r.prompt_len))
        assert r.slo.ttft_ms == pytest.approx(ttft_slowdown * zero_load(r.prompt_len) * 1e3)
        assert r.slo.tpot_ms == tpot_ms
    outputs = np.array([r.output_len for r in reqs])
    assert outputs.mean() == pytest.approx(TABLE4[f"{scenario}.output"].mean, rel=0.1)
    assert all(1 <= r.output_len <= r.max_tokens for r in reqs)
    assert [r.arrival_s for r in reqs] == arrivals(3000)


def test_generation_is_deterministic_for_a_seed() -> None:
    for scenario in Scenario:
        a = generate_workload(scenario, arrivals(30), CONFIG, seed=4)
        assert a == generate_workload(scenario, arrivals(30), CONFIG, seed=4)
        assert a != generate_workload(scenario, arrivals(30), CONFIG, seed=5)


def test_mixed_draws_the_three_applications_evenly() -> None:
    reqs = generate_workload("mixed", arrivals(3000), CONFIG, seed=0)
    counts = {s: sum(r.scenario == s for r in reqs) for s in ("chatbot", "coder", "summarizer")}
    assert all(900 < c < 1100 for c in counts.values()), counts
    assert len({r.request_id for r in reqs}) == 3000
    assert [r.arrival_s for r in reqs] == arrivals(3000)
    assert {r.slo_class for r in reqs} == {"loose/loose", "loose/tight", "tight/loose"}


def test_reasoning_has_a_tight_thinking_stage_then_a_loose_answer() -> None:
    reqs = generate_workload("reasoning", arrivals(500), CONFIG, seed=0)
    thinking = table4_lengths("reasoning.thinking")
    answer = table4_lengths("reasoning.answer")
    for r in reqs:
        # The scheduler is told no boundary: thinking ends when the model outputs its token.
        told, _ = r.slo.stages
        assert told.num_tokens is None and told.end_token_ids == (STAGE_END_TOKEN,)
        ((position, token),) = r.emits
        assert token == STAGE_END_TOKEN
        think, ans = r.judged_slo.stages
        assert (think.tpot_ms, ans.tpot_ms) == (50.0, 100.0)
        assert think.num_tokens == position + 1 and ans.num_tokens is None
        assert not think.end_token_ids
        assert r.output_len > think.num_tokens
        assert r.max_tokens == thinking.cap + answer.cap
        assert r.slo.ttft_ms == pytest.approx(3.0 * zero_load(r.prompt_len) * 1e3)
        n = think.num_tokens
        assert r.judged_slo.tpot_at(n - 1) == 0.05 and r.judged_slo.tpot_at(n) == 0.1
        assert r.slo.tpot_at(n) == 0.05  # until the model ends its thinking
    means = np.mean([r.output_len for r in reqs])
    assert means == pytest.approx(4693 + 803, rel=0.05)


def test_toolllm_sessions_chain_rounds_with_growing_context() -> None:
    reqs = generate_workload("toolllm", arrivals(300), CONFIG, seed=0)
    sessions: dict[str, list[WorkloadRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.request_id.split(".")[0], []).append(r)
    assert len(sessions) == 300
    assert {len(rounds) - 1 for rounds in sessions.values()} == set(TOOL_CALLS)
    for rounds in sessions.values():
        first, *rest = rounds
        assert first.follows is None
        for prev, cur in zip(rounds, rest, strict=False):
            assert cur.follows == prev.request_id
            assert cur.delay_s == CONFIG.tool_latency_s
            assert cur.arrival_s == first.arrival_s
            assert cur.prompt_len > prev.prompt_len + prev.output_len
        for r in rounds:
            assert r.slo.ttft_ms == pytest.approx(3.0 * zero_load(r.prompt_len) * 1e3)
        assert [r.slo.tpot_ms for r in rounds] == [50.0] * len(rest) + [100.0]
        assert rounds[-1].slo_class == "tight/loose"


def test_to_request_hides_the_true_output_length() -> None:
    (w,) = generate_workload("coder", [2.5], CONFIG, seed=3)
    req = w.to_request(list(range(w.prompt_len)))
    assert req.sampling.max_tokens == w.max_tokens
    assert req.sampling.ignore_eos
    assert req.arrival_time == 2.5 and req.slo == w.slo
    with pytest.raises(ValueError, match="the workload asks for"):
        w.to_request(list(range(w.prompt_len + 1)))


def test_follow_up_rounds_need_their_real_arrival_time() -> None:
    reqs = generate_workload("toolllm", [0.0], CONFIG, seed=0)
    second = reqs[1]
    with pytest.raises(ValueError, match="pass its actual arrival_time"):
        second.to_request([0] * second.prompt_len)
    assert second.to_request([0] * second.prompt_len, arrival_time=9.0).arrival_time == 9.0


def test_workload_request_refuses_output_beyond_max_tokens() -> None:
    with pytest.raises(ValueError, match="output_len"):
        WorkloadRequest("x", "chatbot", "loose/loose", 0.0, 10, 20, 16, SLO(100, 50), 0.01)


def test_trace_lengths_replace_the_fit_for_traced_services() -> None:
    rows = [TraceRow(0.0, 500, 30), TraceRow(1.0, 100_000, 5), TraceRow(2.0, 7, 100_000)]
    reqs = generate_workload("chatbot", [0.0, 1.0, 2.0], CONFIG, seed=0, trace_rows=rows)
    cap_p = table4_lengths("chatbot.prompt").cap
    cap_o = table4_lengths("chatbot.output").cap
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(500, 30), (cap_p, 5), (7, cap_o)]
    with pytest.raises(ValueError, match="cannot take trace lengths"):
        generate_workload("summarizer", [0.0, 1.0, 2.0], CONFIG, seed=0, trace_rows=rows)
    with pytest.raises(ValueError, match="2 trace rows for 3 arrivals"):
        generate_workload("coder", [0.0, 1.0, 2.0], CONFIG, seed=0, trace_rows=rows[:2])


def test_cpu_scaled_workload_fits_the_demo_context() -> None:
    step = 0.004
    config = WorkloadConfig(
        zero_load_ttft_s=zero_load,
        targets=SLOTargets.for_decode_step(step),
        length_scale=0.1,
        max_model_len=2048,
    )
    reqs = generate_workload("reasoning", arrivals(200), config, seed=0)
    assert all(r.prompt_len + r.max_tokens <= 2048 for r in reqs)
    assert reqs[0].slo.stages[0].tpot_ms == pytest.approx(3.3 * 4.0)
    assert reqs[0].slo.stages[1].tpot_ms == pytest.approx(6.6 * 4.0)
    tight = WorkloadConfig(zero_load_ttft_s=zero_load, max_model_len=2048)
    with pytest.raises(ValueError, match="lower length_scale"):
        generate_workload("reasoning", arrivals(5), tight, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"length_scale": 0.0}, "length_scale"),
        ({"tool_latency_s": -1.0}, "tool_latency_s"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_bad_config_raises(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(zero_load_ttft_s=zero_load, **kwargs)  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="must be sorted"):
        generate_workload("chatbot", [1.0, 0.5], CONFIG, seed=0)
    with pytest.raises(ValueError, match="must not be empty"):
        generate_workload("chatbot", [], CONFIG, seed=0)
    with pytest.raises(ValueError):
        generate_workload("poetry", [0.0], CONFIG, seed=0)
    broken = WorkloadConfig(zero_load_ttft_s=lambda n: 0.0)
    with pytest.raises(ValueError, match="zero_load_ttft_s"):
        generate_workload("chatbot", [0.0], broken, seed=0)
    with pytest.raises(ValueError, match="exceeds loose_tpot_ms"):
        SLOTargets(tight_tpot_ms=200.0)
    with pytest.raises(ValueError, match="decode_step_s"):
        SLOTargets.for_decode_step(0.0)


def test_zero_load_helpers_use_the_perf_model() -> None:
    model = PerfModel.load(PROFILE)
    ttft = zero_load_ttft_from(model)
    assert 0 < ttft(128) < ttft(2048)
    step = zero_load_decode_step_s(model, 763)
    assert 0 < step < ttft(2048)
    reqs = generate_workload("chatbot", arrivals(5), WorkloadConfig(zero_load_ttft_s=ttft), seed=0)
    assert all(r.zero_load_ttft_s == pytest.approx(ttft(r.prompt_len)) for r in reqs)


def test_bursty_scenarios_replay_the_coding_trace() -> None:
    assert set(TRACE_FILES) == set(Scenario)
    bursty = {s for s, f in TRACE_FILES.items() if f == AZURE_CODE_FILE}
    assert bursty == {Scenario.CODER, Scenario.TOOLLLM}
    assert TRACE_FILES[Scenario.CHATBOT] == AZURE_CONV_FILE


def test_rounds_grow_by_at_least_what_a_chat_adds() -> None:
    """A round planned to grow by 3 tokens grows by 6, and the round after it keeps its own
    growth on top; a workload whose rounds grow enough is unchanged; growing past the
    model's length is refused, naming the round."""
    slo = SLO(1000.0, 100.0)

    def round_(k: int, prompt_len: int) -> WorkloadRequest:
        follows = {"follows": f"s.r{k - 1}", "delay_s": 0.1} if k else {}
        return WorkloadRequest(
            f"s.r{k}", "agent", "tight/loose", 0.0, prompt_len, 2, 4, slo, 0.1, **follows
        )

    session = [round_(0, 40), round_(1, 43), round_(2, 73), round_(3, 100)]
    grown = grow_rounds(session, 6, WorkloadConfig(lambda n: 0.01))
    assert [r.prompt_len for r in grown] == [40, 46, 76, 103]
    assert grown[1].slo == slo and grown[1].output_len == 2
    assert grow_rounds(session, 3, WorkloadConfig(lambda n: 0.01)) == session
    with pytest.raises(ValueError, match=r"s\.r3: prompt 103 \+ max_tokens 4 exceeds"):
        grow_rounds(session, 6, WorkloadConfig(lambda n: 0.01, max_model_len=105))
