"""Mix files: loading (YAML and JSON), errors that name the field, and the requests they give."""

from __future__ import annotations

import itertools
import json
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from cluster.simulator import Policy, SimConfig
from loadgen import mixes
from loadgen.mixes import Lengths, Mix, mix_from_dict, parse_workload
from loadgen.simulate import ROOT, simulate_workload
from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE
from loadgen.workloads import (
    Level,
    LogNormalLengths,
    Scenario,
    SLOTargets,
    WorkloadConfig,
    generate_workload,
    trace_file,
    zero_load_ttft_from,
)
from replica.perf_model import PerfModel
from replica.profiles import resolve_profile

EXAMPLE = ROOT / "loadgen" / "mix-examples" / "services.yaml"


def zero_load(prompt_len: int) -> float:
    return 0.01 + prompt_len * 1e-4


CONFIG = WorkloadConfig(zero_load)


def two_classes() -> dict[str, Any]:
    return {
        "name": "shop",
        "trace": "code",
        "classes": [
            {
                "name": "chat",
                "share": 3,
                "prompt": {"mean": 500, "p99": 1500},
                "output": {"mean": 100, "p99": 400},
                "ttft": "loose",
                "tpot": "tight",
            },
            {
                "name": "search",
                "share": 1,
                "prompt": 64,
                "output": 8,
                "max_tokens": 16,
                "ttft_ms": 250,
                "tpot_ms": 20,
            },
        ],
    }


def test_yaml_and_json_files_give_the_same_mix(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(two_classes()))
    (tmp_path / "a.json").write_text(json.dumps(two_classes()))
    mix = Mix.load(tmp_path / "a.yaml")
    assert mix == Mix.load(tmp_path / "a.json")
    assert (mix.name, mix.value, mix.trace_file) == ("shop", "shop", AZURE_CODE_FILE)
    chat, search = mix.classes
    assert (chat.share, chat.ttft, chat.tpot) == (3.0, Level.LOOSE, Level.TIGHT)
    assert chat.prompt == Lengths(500.0, 1500.0)
    assert (search.prompt, search.output) == (Lengths(64.0), Lengths(8.0))
    assert (search.ttft, search.tpot, search.max_tokens) == (250.0, 20.0, 16)


def test_name_defaults_to_the_file_stem_and_trace_to_conversation(tmp_path: Path) -> None:
    data = two_classes()
    del data["name"], data["trace"]
    (tmp_path / "my-mix.yml").write_text(yaml.safe_dump(data))
    mix = Mix.load(tmp_path / "my-mix.yml")
    assert (mix.name, mix.trace_file) == ("my-mix", AZURE_CONV_FILE)


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = two_classes()
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DROP = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("classes",), [], "classes must be a non-empty list"),
        (("classes",), _DROP, "classes must be a non-empty list"),
        (("trace",), "azure", "trace 'azure' must be one of"),
        (("name",), "a,b", "without commas"),
        (("rate",), 3, "unknown field(s) ['rate']"),
        (("classes", 0, "tpot_s"), 0.05, "class 'chat': unknown field(s) ['tpot_s']"),
        (("classes", 0, "name"), "", "classes[0].name"),
        (("classes", 1, "name"), "chat", "class names must be distinct"),
        (("classes", 0, "share"), 0, "class 'chat': share must be > 0"),
        (("classes", 0, "share"), "half", "class 'chat': share must be a finite number"),
        (("classes", 1, "tpot_ms"), "1e-9", "write 1.0e-9, not 1e-9"),  # YAML 1.1 reads text
        (("classes", 0, "prompt"), {"mean": 500}, "class 'chat': prompt takes {mean, p99}"),
        (("classes", 0, "prompt"), {"mean": 500, "p99": 400}, "class 'chat': prompt: no lognormal"),
        (("classes", 0, "output"), 0, "class 'chat': output must be {mean, p99} or a fixed"),
        (("classes", 0, "output"), 2.5, "class 'chat': output must be"),
        (("classes", 0, "ttft_ms"), 100, "class 'chat': give exactly one of ttft"),
        (("classes", 0, "tpot"), _DROP, "class 'chat': give exactly one of tpot"),
        (("classes", 0, "tpot"), "fast", "class 'chat': tpot must be tight or loose"),
        (("classes", 1, "tpot_ms"), -5, "class 'search': tpot_ms must be > 0"),
        (("classes", 1, "max_tokens"), 0, "class 'search': max_tokens must be an integer"),
    ],
)
def test_errors_name_the_field_and_class(path: tuple[Any, ...], value: Any, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        mix_from_dict(_with(path, value), default_name="x")
    assert message in str(exc.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ends in one of"):
        Mix.load(tmp_path / "mix.txt")
    with pytest.raises(ValueError, match=r"cannot read mix file .*missing.yaml"):
        Mix.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read mix file .*bad.json"):
        Mix.load(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- chat\n")
    with pytest.raises(ValueError, match=r"list.yaml: expected a mapping"):
        Mix.load(tmp_path / "list.yaml")


def test_parse_workload_takes_scenario_names_and_mix_files(tmp_path: Path) -> None:
    assert parse_workload("coder") is Scenario.CODER
    (tmp_path / "m.json").write_text(json.dumps(two_classes()))
    assert parse_workload(str(tmp_path / "m.json")).value == "shop"
    with pytest.raises(ValueError, match=r"'poetry' is neither a scenario .* nor a mix file"):
        parse_workload("poetry")


def test_trace_file_of_scenarios_and_mixes() -> None:
    assert trace_file(Scenario.CODER) == AZURE_CODE_FILE
    assert trace_file(mix_from_dict(two_classes(), "x")) == AZURE_CODE_FILE


def test_a_mix_replays_a_trace_of_its_own(tmp_path: Path) -> None:
    """`trace` may name a CSV in the Azure format, relative to the mix file; it is read when
    the mix is, so a bad one is named before anything runs."""
    (tmp_path / "logs").mkdir()
    own = tmp_path / "logs" / "ours.csv"
    own.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00,5,1\n")
    mix_file = tmp_path / "m.yaml"
    mix_file.write_text(yaml.safe_dump(two_classes() | {"trace": "logs/ours.csv"}))
    with pytest.raises(ValueError, match=r"m.yaml: trace 'logs/ours.csv' must be .* 2 rows"):
        Mix.load(mix_file)
    with own.open("a") as f:
        f.write("2024-01-01 00:00:02,7,3\n")
    mix = Mix.load(mix_file)
    assert mix.trace_file == str(own.resolve())
    again = mix_from_dict(json.loads(json.dumps(mix.to_dict())), "x")  # the results' form
    assert again.trace_file == mix.trace_file
    with pytest.raises(ValueError, match=r"trace 'ours.txt' must be one of .*ours.txt' does not"):
        mix_from_dict(two_classes() | {"trace": "ours.txt"}, "x", base=tmp_path)


def test_requests_follow_the_classes() -> None:
    mix = mix_from_dict(two_classes(), "x")
    arrivals = [i * 0.01 for i in range(4000)]
    out = generate_workload(mix, arrivals, CONFIG, seed=3)
    assert len(out) == 4000
    assert [r.arrival_s for r in out] == arrivals  # one request per arrival, in order
    assert len({r.request_id for r in out}) == 4000
    counts = Counter(r.scenario for r in out)
    assert counts["chat"] / 4000 == pytest.approx(0.75, abs=0.03)  # shares 3 : 1
    chat = [r for r in out if r.scenario == "chat"]
    search = [r for r in out if r.scenario == "search"]
    assert {r.slo_class for r in chat} == {"chat"} and {r.slo_class for r in search} == {"search"}
    # Fixed lengths as written; the request asks for max_tokens, not its true length.
    assert {(r.prompt_len, r.output_len, r.max_tokens) for r in search} == {(64, 8, 16)}
    assert {(r.slo.ttft_ms, r.slo.tpot_ms) for r in search} == {(250.0, 20.0)}
    # Levels follow the run's targets: loose TTFT = 5x the prompt's zero-load TTFT.
    for r in chat[:50]:
        assert r.zero_load_ttft_s == zero_load(r.prompt_len)
        assert r.slo.ttft_ms == pytest.approx(5 * zero_load(r.prompt_len) * 1e3)
        assert r.slo.tpot_ms == SLOTargets().tight_tpot_ms
    # Lognormal lengths with the file's mean; max_tokens is the fit's largest length.
    cap = LogNormalLengths(100, 400).cap
    assert {r.max_tokens for r in chat} == {cap}
    assert all(1 <= r.output_len <= cap for r in chat)
    assert np.mean([r.prompt_len for r in chat]) == pytest.approx(500, rel=0.05)
    assert out == generate_workload(mix, arrivals, CONFIG, seed=3)
    assert out != generate_workload(mix, arrivals, CONFIG, seed=4)


def test_length_scale_shrinks_lengths_and_max_tokens_not_absolute_slos() -> None:
    mix = mix_from_dict(two_classes(), "x")
    config = WorkloadConfig(zero_load, SLOTargets.for_decode_step(0.004), length_scale=0.1)
    out = generate_workload(mix, [0.0] * 400, config, seed=0)
    search = [r for r in out if r.scenario == "search"]
    assert {(r.prompt_len, r.output_len, r.max_tokens) for r in search} == {(6, 1, 2)}
    assert {(r.slo.ttft_ms, r.slo.tpot_ms) for r in search} == {(250.0, 20.0)}
    chat = [r for r in out if r.scenario == "chat"]
    assert {r.max_tokens for r in chat} == {LogNormalLengths(10, 40).cap}
    assert all(r.slo.tpot_ms == pytest.approx(3.3 * 4.0) for r in chat)


def test_a_mix_refuses_requests_the_model_cannot_hold() -> None:
    mix = mix_from_dict(two_classes(), "x")
    with pytest.raises(ValueError, match=r"^class 'chat': chat-.* exceeds max_model_len=50"):
        generate_workload(mix, [0.0] * 10, WorkloadConfig(zero_load, max_model_len=50), seed=0)


def test_a_request_whose_slo_cannot_be_set_names_its_class() -> None:
    """A prompt so long its TTFT target passes a day: the SLO's error, with the class."""
    data = two_classes()
    search = {key: value for key, value in data["classes"][1].items() if key != "ttft_ms"}
    data["classes"][1] = search | {"prompt": 200_000_000, "ttft": "loose"}  # 20,000 s idle
    mix = mix_from_dict(data, "x")
    with pytest.raises(ValueError, match=r"^class 'search': slo.ttft_ms must be <= 8.64e\+07"):
        generate_workload(mix, [0.0] * 10, CONFIG, seed=0)


def test_the_shipped_example_loads() -> None:
    mix = Mix.load(EXAMPLE)
    assert mix.name == "services"
    assert [c.name for c in mix.classes] == ["chat", "copilot", "summarize", "agent", "reasoner"]
    assert [s.name for s in mix.classes[-1].stages] == ["thinking"]
    assert sum(c.share for c in mix.classes) == pytest.approx(1.0)
    prompts = Mix.load(EXAMPLE.parent / "system-prompts.yaml")
    assert [(c.name, c.system_prompt) for c in prompts.classes] == [("support", 1000), ("chat", 0)]
    assert mix_from_dict(prompts.to_dict(), "other") == prompts
    agents = Mix.load(EXAMPLE.parent / "agents.yaml")
    agent = agents.classes[0]
    assert agent.system_prompt == 800 and agent.tools is not None
    assert mix_from_dict(agents.to_dict(), "other") == agents


def reasoner(**extra: Any) -> dict[str, Any]:
    return {
        "name": "reasoner",
        "share": 1,
        "prompt": 100,
        "stages": [{"name": "thinking", "tokens": {"mean": 1000, "p99": 2000}, "tpot": "tight"}],
        "output": {"mean": 200, "p99": 500},
        "ttft": "tight",
        "tpot": "loose",
        **extra,
    }


def test_stages_come_before_the_answer_each_with_its_tpot() -> None:
    mix = mix_from_dict({"classes": [reasoner()]}, "x")
    out = generate_workload(mix, [0.0] * 300, CONFIG, seed=1)
    thinking_cap, answer_cap = LogNormalLengths(1000, 2000).cap, LogNormalLengths(200, 500).cap
    targets = SLOTargets()
    thinking = []
    for r in out:
        # The planner is told no boundary; the stage ends where the model outputs its token.
        assert r.slo.stages[0].num_tokens is None and r.slo.stages[0].end_token_ids
        first, answer = r.judged_slo.stages
        assert (first.name, first.tpot_ms) == ("thinking", targets.tight_tpot_ms)
        assert (answer.name, answer.tpot_ms, answer.num_tokens) == (
            "answer",
            targets.loose_tpot_ms,
            None,
        )
        assert r.slo.tpot_ms == targets.tight_tpot_ms
        assert r.slo.ttft_ms == pytest.approx(3 * zero_load(100) * 1e3)
        assert first.num_tokens is not None and 1 <= first.num_tokens <= thinking_cap
        # The true length is the thinking plus an answer; the request asks for both caps.
        assert first.num_tokens < r.output_len <= first.num_tokens + answer_cap
        assert r.max_tokens == thinking_cap + answer_cap
        thinking.append(first.num_tokens)
    assert np.mean(thinking) == pytest.approx(1000, rel=0.05)
    # The deadline line switches TPOT at the stage boundary.
    slo = out[0].judged_slo
    k = slo.stages[0].num_tokens
    assert k is not None
    step = slo.deadline_s(k + 1) - slo.deadline_s(k)
    assert step == pytest.approx(targets.loose_tpot_ms / 1e3)


def test_stage_errors_name_the_stage() -> None:
    cases = [
        ({"name": "t", "tokens": 10, "tpot": "tight", "ttft": "x"}, "stages[0]: unknown field"),
        ({"name": "t", "tpot": "tight"}, "stages[0].tokens must be"),
        ({"tokens": 10, "tpot": "tight", "tpot_ms": 5}, "stages[0]: give exactly one of tpot"),
        ({"name": 3, "tokens": 10, "tpot": "tight"}, "stages[0].name must be a string"),
    ]
    for stage, message in cases:
        with pytest.raises(ValueError) as exc:
            mix_from_dict({"classes": [reasoner(stages=[stage])]}, "x")
        assert "class 'reasoner': " in str(exc.value) and message in str(exc.value)
    with pytest.raises(ValueError, match="stages must be a list"):
        mix_from_dict({"classes": [reasoner(stages={"name": "t"})]}, "x")


def test_the_documented_example_loads() -> None:
    doc = mixes.__doc__ or ""
    block = doc.split("):\n\n", 1)[1].split("\n\n", 1)[0]
    mix = mix_from_dict(yaml.safe_load(textwrap.dedent(block)), "x")
    assert [c.name for c in mix.classes] == ["chat", "copilot", "reasoner", "support", "agent"]
    assert mix.classes[1].max_tokens == 64 and mix.classes[2].stages[0].name == "thinking"
    assert mix.classes[3].system_prompt == 256 and mix.classes[0].system_prompt == 0
    tools = mix.classes[4].tools
    assert tools is not None and (tools.calls, tools.tpot, tools.latency_ms) == (
        (1, 3),
        Level.TIGHT,
        100.0,
    )


def agent(**tools: Any) -> dict[str, Any]:
    return {
        "name": "agent",
        "share": 1,
        "prompt": 200,
        "output": {"mean": 40, "p99": 120},
        "ttft": "tight",
        "tpot": "loose",
        "tools": {"calls": [1, 3], "response": 30, "tpot": "tight", **tools},
    }


def test_tool_sessions_are_rounds_that_follow_each_other() -> None:
    mix = mix_from_dict({"classes": [agent(latency_ms=250)]}, "x")
    arrivals = [float(i) for i in range(200)]
    out = generate_workload(mix, arrivals, CONFIG, seed=2)
    sessions: dict[str, list[Any]] = {}
    for r in out:
        sessions.setdefault(r.request_id.split(".")[0], []).append(r)
    assert len(sessions) == 200  # the rate counts sessions
    assert {len(rounds) for rounds in sessions.values()} == {2, 3, 4}  # 1-3 calls + the answer
    targets = SLOTargets()
    for rounds in sessions.values():
        rounds.sort(key=lambda r: r.request_id)
        first, *rest = rounds
        assert (first.follows, first.delay_s, first.prompt_len) == (None, 0.0, 200)
        assert {r.arrival_s for r in rounds} == {first.arrival_s}
        for before, after in itertools.pairwise(rounds):
            assert (after.follows, after.delay_s) == (before.request_id, 0.25)
            # The next prompt is this one, its output and the tool's 30-token response.
            assert after.prompt_len == before.prompt_len + before.output_len + 30
        assert [r.slo.tpot_ms for r in rounds] == [targets.tight_tpot_ms] * len(rest) + [
            targets.loose_tpot_ms
        ]
        for r in rounds:
            assert r.slo.ttft_ms == pytest.approx(3 * zero_load(r.prompt_len) * 1e3)


def test_tool_defaults_and_errors() -> None:
    data = agent()
    del data["tools"]["tpot"], data["tools"]["response"]
    tools = mix_from_dict({"classes": [data]}, "x").classes[0].tools
    assert tools is not None
    assert (tools.tpot, tools.latency_ms, tools.response) == (None, None, Lengths(128.0, 512.0))
    config = WorkloadConfig(zero_load, tool_latency_s=0.5)
    out = generate_workload(mix_from_dict({"classes": [data]}, "x"), [0.0], config, seed=0)
    assert {r.delay_s for r in out if r.follows} == {0.5}  # the run's tool latency
    assert {r.slo.tpot_ms for r in out} == {SLOTargets().loose_tpot_ms}  # the class's TPOT
    cases = [
        (agent(calls=[3, 1]), "tools.calls must be a count >= 1 or [fewest, most]"),
        (agent(calls=0), "tools.calls must be"),
        (agent(calls="2"), "tools.calls must be"),
        (agent(wait_ms=3), "tools: unknown field(s) ['wait_ms']"),
        (agent(latency_ms=-1), "tools.latency_ms must be > 0"),
        (agent() | {"stages": [{"tokens": 5, "tpot": "tight"}]}, "stages and tools do not"),
    ]
    for cls, message in cases:
        with pytest.raises(ValueError) as exc:
            mix_from_dict({"classes": [cls]}, "x")
        assert "class 'agent': " in str(exc.value) and message in str(exc.value)


def test_tool_rounds_run_in_the_simulator_after_their_predecessor() -> None:
    """The simulator issues a follow-up round only after its predecessor's last token plus
    the tool latency, whatever its session's arrival time says."""
    perf = PerfModel.load(resolve_profile("a100-40gb-opt-7b-tp1"))
    mix = mix_from_dict({"classes": [agent(calls=2, latency_ms=100)]}, "x")
    config = WorkloadConfig(zero_load_ttft_from(perf))
    workload = generate_workload(mix, [0.0, 0.5, 1.0], config, seed=0)
    _, _, records = simulate_workload(perf, workload, SimConfig(policy=Policy.SLOS))
    by_id = {r.request_id: r for r in records}
    assert len(records) == 9 and all(r.complete for r in records)
    for w in workload:
        if w.follows is not None:
            before = by_id[w.follows]
            assert by_id[w.request_id].arrival_s >= before.token_times_s[-1] + 0.1 - 1e-9


def test_a_mix_reads_back_from_its_dict() -> None:
    """Results carry `Mix.to_dict()`, which is the file's form: the run can be redone from it."""
    doc = mixes.__doc__ or ""
    documented = mix_from_dict(
        yaml.safe_load(textwrap.dedent(doc.split("):\n\n", 1)[1].split("\n\n", 1)[0])), "x"
    )
    for mix in (documented, Mix.load(EXAMPLE), mix_from_dict(two_classes(), "x")):
        data = json.loads(json.dumps(mix.to_dict()))
        assert mix_from_dict(data, "other") == mix
    assert documented.to_dict()["classes"][1] == {
        "name": "copilot",
        "share": 0.3,
        "prompt": {"mean": 847.0, "p99": 2010.0},
        "output": 32,
        "ttft_ms": 400.0,
        "tpot_ms": 40.0,
        "max_tokens": 64,
    }


def test_a_system_prompt_starts_every_request_of_its_class_scaled_like_its_lengths() -> None:
    support = {
        "name": "support",
        "share": 1,
        "prompt": {"mean": 300, "p99": 900},
        "output": 8,
        "system_prompt": 256,
        "ttft": "loose",
        "tpot": "loose",
    }
    tooled = {**agent(), "system_prompt": 120}
    mix = mix_from_dict({"classes": [support, tooled, two_classes()["classes"][1]]}, "x")
    for scale, system, tools_system in ((1.0, 256, 120), (0.1, 26, 12)):
        config = WorkloadConfig(zero_load, length_scale=scale)
        out = generate_workload(mix, [0.0] * 600, config, seed=5)
        by_class: dict[str, list[Any]] = {}
        for r in out:
            by_class.setdefault(r.scenario, []).append(r)
        assert {(r.shared_prefix, r.prefix_len) for r in by_class["support"]} == {
            ("support", system)
        }
        assert min(r.prompt_len for r in by_class["support"]) == system + 1  # lengthened
        assert {(r.shared_prefix, r.prefix_len) for r in by_class["agent"]} == {
            ("agent", tools_system)
        }
        assert {r.shared_prefix for r in by_class["search"]} == {None}
    for bad in (-1, 1.5, True, "256"):
        with pytest.raises(ValueError, match="class 'support': system_prompt must be an integer"):
            mix_from_dict({"classes": [{**support, "system_prompt": bad}]}, "x")
