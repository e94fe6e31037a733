"""`slos-serve loadgen`: option errors name the option; a short run against the real front door
(the demo pair, 2 replicas, backup policy reject: tests/router/conftest.py), and the gRPC and
in-process clients on the same cluster."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from loadgen import cli
from loadgen.clients import GrpcClient, HttpClient, InProcessClient, LoadClient, Reply
from loadgen.metrics import report, run_span_s
from loadgen.prompts import Prompt
from loadgen.records import RequestRecord, Verdict, read_records
from loadgen.run_load import RunResult, prefix_credit_missed, summary_table
from loadgen.workloads import CPU_TIGHT_TPOT_FACTOR, WorkloadRequest
from loadgen.zero_load import ZeroLoad
from replica.request import SLO
from router.local import LocalFrontDoor
from tests.cluster.conftest import write_profile
from tests.loadgen.test_metrics import rec
from tests.router.conftest import API_KEY, live

NOT_ZERO_LOAD = Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "cpu-demo.json"

__all__ = ["live"]
LOOSE = SLO(5000.0, 500.0)
IMPOSSIBLE = SLO(0.001, 0.001)
"""No replica can promise a first token within a microsecond."""


def generous_zero_load(tmp_path: Path) -> Path:
    """A zero-load file whose 2 s TTFT makes every SLO loose."""
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps(ZeroLoad(2.0, 0.0, 0.1, "generous").to_dict()))
    return zero


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--rate", "0"], "--rate"),
        (["--rate", "1", "--duration", "-1"], "--duration"),
        (["--rate", "1", "--length-scale", "nan"], "--length-scale"),
        (["--rate", "1", "--cv", "2"], "--cv"),
        (["--rate", "1", "--arrivals", "gamma"], "--cv"),
        (["--rate", "1", "--trace", "x.csv"], "--trace"),
        (["--rate", "1", "--target", "localhost:8000"], "--target"),
        (["--rate", "1", "--protocol", "grpc", "--target", "http://h:1"], "--target"),
        (["--rate", "1", "--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--rate", "1", "--json", "/nonexistent/out.json"], "--json"),
        (["--duration", "5"], "--rate"),
        (["--rate", "1", "--rates", "1,2"], "--rates"),
        (["--capacity"], "--rates"),
        (["--capacity", "--rates", "2,1"], "--rates"),
        (["--capacity", "--rates", "1,x"], "--rates"),
        (["--capacity", "--rates", "1,2", "--rate", "3"], "--rate"),
        (["--rate", "1", "--rel-tol", "0"], "--rel-tol"),
        (["--capacity", "--rates", "1,2", "--rel-tol", "5"], "--rel-tol must be > 0 and <= 1"),
        (["--rate", "1", "--max-model-len", "-5"], "--max-model-len: must be an integer >= 2"),
        (["--rate", "1", "--max-model-len", "1"], "--max-model-len: must be an integer >= 2"),
        (["--rate", "1", "--replicas", "0"], "--replicas"),
        (["--rate", "1", "--arrivals", "trace", "--trace", "/nonexistent.csv"], "--trace"),
        (["--rate", "1", "--zero-load", str(NOT_ZERO_LOAD)], "--zero-load: "),
    ],
)
def test_bad_options_fail_naming_the_option(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["loadgen", *args])
    assert named in str(exc.value.code) + capsys.readouterr().err  # ours, or argparse's


def test_a_chat_endpoint_needs_a_chat_template_that_takes_a_system_prompt(
    target_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(target_dir / "tokenizer.json", tmp_path)
    args = ["loadgen", "--rate", "1", "--endpoint", "chat", "--tokenizer", str(tmp_path)]
    with pytest.raises(SystemExit, match=r"--endpoint chat: --tokenizer .* has no chat template"):
        cli.main(args)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(SystemExit, match=r"cannot render a system, user, assistant, user chat"):
        cli.main(args)


def test_a_bad_scenario_or_mix_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--scenario: 'poetry' is neither a scenario"):
        cli.main(["loadgen", "--rate", "1", "--scenario", "poetry"])
    mix = tmp_path / "mix.yaml"
    mix.write_text("classes: [{name: chat, share: 1, prompt: 10, output: 5, ttft: soon}]\n")
    with pytest.raises(SystemExit, match=r"mix.yaml: class 'chat': ttft must be tight or loose"):
        cli.main(["loadgen", "--rate", "1", "--scenario", str(mix)])


def test_unreachable_target_is_named() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["loadgen", "--rate", "1", "--target", "http://127.0.0.1:9"])
    assert "--target" in str(exc.value.code)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_that_wants_a_key_is_named_before_the_run(live: LocalFrontDoor) -> None:
    """Without --api-key no request of the run would be served: the error says so, also when
    --model and --max-model-len spare the model list."""
    base = ["loadgen", "--target", live.http_url, "--rate", "1", "--duration", "1"]
    for extra in ([], ["--model", "demo", "--max-model-len", "2048"]):
        with pytest.raises(SystemExit) as exc:
            cli.main([*base, *extra, "--no-progress"])
        assert "answered 401 with no --api-key" in str(exc.value.code), extra
    with pytest.raises(SystemExit) as exc:
        cli.main([*base, "--api-key", "sk-wrong", "--no-progress"])
    assert "answered 401 with the --api-key given" in str(exc.value.code)
    grpc = ["loadgen", "--target", live.grpc_target, "--protocol", "grpc", "--rate", "1"]
    with pytest.raises(SystemExit) as exc:  # it said the server "does not answer"
        cli.main([*grpc, "--duration", "1", "--no-progress"])
    assert "answered UNAUTHENTICATED (missing API key" in str(exc.value.code)
    assert str(exc.value.code).endswith(
        "with no --api-key: the server wants a valid API key (--api-key)"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loadgen_run_against_the_front_door(live: LocalFrontDoor, tmp_path: Path) -> None:
    profile = write_profile(tmp_path / "profile.json")
    out, records_path = tmp_path / "out.json", tmp_path / "run.jsonl"
    code = cli.main(
        [
            "loadgen",
            *("--target", live.http_url, "--api-key", API_KEY, "--scenario", "chatbot"),
            *("--rate", "3", "--duration", "2", "--length-scale", "0.05"),
            *("--profile", str(profile), "--records", str(records_path), "--json", str(out)),
            *("--zero-load", "probe"),
            "--no-progress",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    records = read_records(records_path)
    assert summary["requests"] == len(records) == 6
    assert (result["model"], result["replicas"], result["scheduler"]) == ("demo", 2, "slos")
    zero = ZeroLoad.load(out)
    assert zero.source == f"probe of {live.http_url}"
    assert 0 < zero.ttft_s(1) < 5 and 0 < zero.decode_step_s < 1
    assert result["slo_targets"]["tight_tpot_ms"] == pytest.approx(
        CPU_TIGHT_TPOT_FACTOR * zero.decode_step_s * 1e3
    )
    assert sum(summary["verdicts"].values()) == 6
    counted = summary["server_counters"]
    assert sum(counted.get(k, 0) for k in ("admitted", "best_effort", "rejected")) == 6
    assert counted.get("rejected", 0) == summary["verdicts"]["rejected"]
    # The replicas' step time during the run per request sent (none when all were rejected).
    busy = counted["busy_us"] / 1e3 / 6 if "busy_us" in counted else None
    assert summary["busy_ms_per_request"] == pytest.approx(busy)
    for r in records:
        if r.verdict is Verdict.REJECTED:
            assert r.delivered == 0 and r.error is not None and r.error.startswith("HTTP 429")
        else:
            assert r.error is None and r.complete, r
    attained = summary["attainment"] * 6
    assert attained == round(attained) and 0 <= summary["attainment"] <= 1
    assert set(summary["by_slo_class"]) == {"loose/loose"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mix_file_through_the_front_door(live: LocalFrontDoor, tmp_path: Path) -> None:
    """A user's own mix drives the live cluster: its classes' SLOs reach the server as written
    (absolute) or from the run's levels, and the report groups by class."""
    zero = generous_zero_load(tmp_path)
    mix = tmp_path / "shop.yaml"
    mix.write_text(
        "name: shop\n"
        "classes:\n"
        "  - {name: chat, share: 1, prompt: 40, output: 6, ttft: loose, tpot: loose}\n"
        "  - {name: quick, share: 1, prompt: 20, output: 3, ttft_ms: 4000, tpot_ms: 400}\n"
    )
    out, records_path = tmp_path / "out.json", tmp_path / "run.jsonl"
    code = cli.main(
        [
            "loadgen",
            *("--target", live.http_url, "--api-key", API_KEY, "--scenario", str(mix)),
            *("--rate", "3", "--duration", "2", "--length-scale", "1", "--zero-load", str(zero)),
            *("--records", str(records_path), "--json", str(out), "--no-progress"),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["scenario"] == "shop"
    assert [c["name"] for c in result["mix"]["classes"]] == ["chat", "quick"]
    records = read_records(records_path)
    assert len(records) == 6
    by_class = {r.slo_class: r for r in records}
    assert set(by_class) == set(result["summary"]["by_slo_class"]) <= {"chat", "quick"}
    for r in records:
        assert r.scenario == r.slo_class and r.request_id.startswith(r.slo_class)
        if r.slo_class == "quick":
            assert (r.prompt_len, r.output_len, r.slo.ttft_ms, r.slo.tpot_ms) == (20, 3, 4000, 400)
        else:
            assert (r.prompt_len, r.output_len) == (40, 6)
            assert r.slo.ttft_ms == pytest.approx(5 * 2000.0)  # loose: 5x the 2 s zero load
        if r.verdict is not Verdict.REJECTED:
            assert r.error is None and r.complete, r


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_chat_sessions_through_the_front_door(
    live: LocalFrontDoor, tmp_path: Path, protocol: str
) -> None:
    """`--endpoint chat` sends chats: a system prompt, then a session's rounds, each the chat so
    far with the output the server gave as the assistant's message. Every round is served.
    Two of a session's three rounds ran on one of the two replicas, the later after the
    earlier ended, so at least its system prompt (two blocks) was found cached."""
    zero = generous_zero_load(tmp_path)
    mix = tmp_path / "agents.yaml"
    mix.write_text(
        "name: agents\n"
        "classes:\n"
        "  - {name: agent, share: 1, prompt: 80, output: 6, system_prompt: 40, ttft: loose,\n"
        "     tpot: loose, tools: {calls: 2, response: 12}}\n"
    )
    target = live.http_url if protocol == "http" else live.grpc_target
    out, records_path = tmp_path / "out.json", tmp_path / "run.jsonl"
    code = cli.main(
        [
            "loadgen",
            *("--protocol", protocol, "--target", target, "--api-key", API_KEY),
            *("--endpoint", "chat", "--scenario", str(mix), "--rate", "2", "--duration", "1"),
            *("--length-scale", "1", "--zero-load", str(zero), "--no-progress"),
            *("--records", str(records_path), "--json", str(out)),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["endpoint"] == "chat" and result["summary"]["requests"] == 6
    records = read_records(records_path)
    assert sorted(r.request_id[-3:] for r in records) == [".r0", ".r0", ".r1", ".r1", ".r2", ".r2"]
    assert all(r.complete and r.error is None for r in records), records
    assert result["summary"]["server_counters"]["prefix_cache_hits"] >= 32


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_capacity_search_against_the_front_door(live: LocalFrontDoor, tmp_path: Path) -> None:
    """Loose SLOs and a tiny load pass at every rate: the search climbs to the upper bound.
    Both points send the same two requests (2 s at the start rate 1)."""
    zero = generous_zero_load(tmp_path)
    out, records_path = tmp_path / "cap.json", tmp_path / "cap.jsonl"
    code = cli.main(
        [
            "loadgen",
            *("--target", live.http_url, "--api-key", API_KEY, "--scenario", "coder"),
            *("--capacity", "--rates", "1,2", "--duration", "2", "--cooldown", "0"),
            *("--length-scale", "0.05", "--zero-load", str(zero)),
            *("--records", str(records_path), "--json", str(out), "--no-progress"),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert [p["rate"] for p in summary["points"]] == [1.0, 2.0]
    assert summary["capacity_rps"] == 2.0 and summary["capacity_per_replica"] == 1.0
    assert summary["bound"] == {"at_least": 2.0}  # every rate passed: a bound, not a capacity
    # No flag claims the curve was checked: the search cannot see a non-monotone one.
    assert "monotone" not in summary and "monotone" not in result["capacity_search"]
    assert result["zero_load"]["source"] == "generous"
    assert result["reference_rate"] == 1.0
    sent = [
        sorted(r.request_id for r in read_records(tmp_path / f"cap.rate{rate}.jsonl"))
        for rate in (1, 2)
    ]
    assert len(sent[0]) == 2 and sent[0] == sent[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loadgen_over_grpc(
    live: LocalFrontDoor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zero = generous_zero_load(tmp_path)
    out = tmp_path / "grpc.json"
    code = cli.main(
        [
            "loadgen",
            *("--protocol", "grpc", "--target", live.grpc_target, "--api-key", API_KEY),
            *("--scenario", "summarizer", "--rate", "2", "--duration", "1"),
            *("--length-scale", "0.05", "--zero-load", str(zero), "--json", str(out)),
            *("--records", str(tmp_path / "grpc.jsonl")),
            "--no-progress",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and result["summary"]["requests"] == 2
    counted = result["summary"]["server_counters"]
    assert counted["admitted"] == 2 and counted["steps"] >= 1 and counted["busy_us"] > 0
    assert result["summary"]["busy_ms_per_request"] == pytest.approx(counted["busy_us"] / 2e3)
    busy = result["summary"]["busy_ms_per_request"]
    printed = capsys.readouterr().out
    assert f"replica step time: {busy:.1f} ms a request" in printed
    # Prompts were looked up in the prefix cache as their prefills began (counted with the
    # steps the controller folded in, as busy_us is).
    queries, hits = counted["prefix_cache_queries"], counted.get("prefix_cache_hits", 0)
    assert queries >= min(r.prompt_len for r in read_records(tmp_path / "grpc.jsonl"))
    assert result["summary"]["prefix_hit_rate"] == hits / queries
    assert f"prefix cache: {hits / queries:.1%} of the tokens looked up were cached" in printed
    span = run_span_s(read_records(tmp_path / "grpc.jsonl"))
    fraction = result["summary"]["replica_busy_fraction"]
    assert fraction == pytest.approx(counted["busy_us"] / 1e6 / (2 * span)) and 0 < fraction < 1
    assert result["summary"]["attainment"] == 1.0


def test_unreachable_grpc_target_is_named() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["loadgen", "--rate", "1", "--protocol", "grpc", "--target", "127.0.0.1:9"])
    assert "--target" in str(exc.value.code)


def request(
    rid: str, prompt_len: int, output_len: int, max_tokens: int, slo: SLO = LOOSE
) -> WorkloadRequest:
    return WorkloadRequest(
        request_id=rid,
        scenario="chatbot",
        slo_class="loose/loose",
        arrival_s=0.0,
        prompt_len=prompt_len,
        output_len=output_len,
        max_tokens=max_tokens,
        slo=slo,
        zero_load_ttft_s=0.5,
    )


async def send_three(make: Callable[[], LoadClient], prompt: Prompt) -> list[Reply]:
    """One request closed at output_len (its verdict announced with the first token), one
    that runs to max_tokens (final report), one no replica can promise (the backup policy
    rejects it). The client is made on the running loop (grpc.aio binds a channel to it)."""
    client = make()
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    n = len(prompt.token_ids)
    try:
        cut = await client.send(request("cut", n, 3, 12), prompt, clock)
        full = await client.send(request("full", n, 4, 4), prompt, clock)
        refused = await client.send(request("refused", n, 4, 4, IMPOSSIBLE), prompt, clock)
    finally:
        await client.aclose()
    return [cut, full, refused]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", ["http", "grpc", "inprocess"])
def test_each_client_on_the_live_cluster(live: LocalFrontDoor, protocol: str) -> None:
    text = "def greet(name):\n    return"
    prompt = Prompt(text, tuple(live.door.codec.encode(text)))
    tokenizer = live.door.codec.tokenizer
    clients: dict[str, Callable[[], LoadClient]] = {
        "http": partial(
            HttpClient,
            live.http_url,
            "demo",
            api_key=API_KEY,
            count_tokens=lambda t: len(tokenizer.encode(t, add_special_tokens=False).ids),
        ),
        "grpc": partial(GrpcClient, live.grpc_target, api_key=API_KEY),
        "inprocess": partial(InProcessClient, live.handle, tokenizer.decode),
    }
    if protocol == "inprocess":
        replies = live.run(send_three(clients[protocol], prompt))
    else:
        replies = asyncio.run(send_three(clients[protocol], prompt))
    cut, full, refused = (reply.record for reply in replies)
    assert all(reply.text for reply in replies[:2]) and replies[2].text == ""
    assert cut.delivered >= 3 and cut.verdict is Verdict.ADMITTED and cut.error is None
    assert cut.replica in ("0", "1") and cut.hops >= 0
    assert full.delivered == 4 and full.verdict is Verdict.ADMITTED
    assert full.replica in ("0", "1") and full.hops >= 0 and full.error is None
    assert cut.arrival_s < cut.token_times_s[0] <= cut.token_times_s[-1] < full.arrival_s
    assert refused.verdict is Verdict.REJECTED and refused.delivered == 0
    assert refused.error is not None and "SLO" in refused.error


@pytest.mark.parametrize(
    ("counters", "missed"),
    [
        (None, None),
        ({"prefix_cache_hits": 5}, None),
        ({"prefix_credited": 200, "prefix_credit_missed": 50}, 0.25),
        ({"prefix_credited": 64}, 0.0),
    ],
)
def test_the_share_of_credited_prefix_tokens_not_found(
    counters: dict[str, int] | None, missed: float | None
) -> None:
    records = [rec([1.0, 1.1])]
    result = RunResult(1.0, records, report(records), 0.0, counters)
    assert prefix_credit_missed(result) == missed


def test_the_summary_table_keeps_counts_apart_at_any_size() -> None:
    """Four-digit verdict counts (an overload run) stay separate columns."""
    records = _records(2_000)
    table = summary_table(RunResult(2.0, records, report(records), 0.0, None))
    row = next(line for line in table.splitlines() if line.startswith("all"))
    assert row.split()[1:6] == ["2000", "1000", "1000", "0", "0"]


def _records(n: int) -> list[RequestRecord]:
    slo = SLO(ttft_ms=100.0, tpot_ms=50.0)
    return [
        RequestRecord(
            request_id=f"r{i}",
            scenario="chatbot",
            slo_class="tight/tight",
            arrival_s=0.0,
            prompt_len=4,
            output_len=1,
            slo=slo,
            zero_load_ttft_s=0.05,
            verdict="admitted" if i % 2 else "best_effort",
            token_times_s=(0.05,),
        )
        for i in range(n)
    ]
