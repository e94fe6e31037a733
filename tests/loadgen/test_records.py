"""Records: JSONL round trip and validation of what a results file may hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadgen.records import RecordWriter, RequestRecord, Verdict, read_records, write_records
from loadgen.workloads import WorkloadConfig, generate_workload
from replica.request import SLO, Stage


def record(**overrides: Any) -> RequestRecord:
    fields: dict[str, Any] = {
        "request_id": "r1",
        "scenario": "reasoning",
        "slo_class": "tight/tight+loose",
        "arrival_s": 1.0,
        "prompt_len": 12,
        "output_len": 3,
        "slo": SLO(300.0, 50.0, (Stage(50.0, num_tokens=2, name="thinking"), Stage(100.0))),
        "zero_load_ttft_s": 0.1,
        "verdict": Verdict.ADMITTED,
        "token_times_s": (1.2, 1.25, 1.25),
        "replica": "replica-0",
        "hops": 1,
    }
    fields.update(overrides)
    return RequestRecord(**fields)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    records = [
        record(),
        record(request_id="r2", verdict="rejected", token_times_s=(), replica=None, hops=3),
        record(request_id="r3", verdict="best_effort", slo=SLO(100.0, 20.0)),
        record(request_id="r4", verdict="unknown", error="HTTP 500: boom"),
    ]
    path = tmp_path / "run.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    first = json.loads(path.read_text().splitlines()[0])
    assert first["first_token_s"] == 1.2
    assert first["slo"]["stages"][0] == {
        "tpot_ms": 50.0,
        "num_tokens": 2,
        "ttft_ms": None,
        "name": "thinking",
    }


def test_writer_streams_and_refuses_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with RecordWriter(path) as writer:
        writer.write(record())
        assert len(path.read_text().splitlines()) == 1
        with pytest.raises(ValueError, match="duplicate"):
            writer.write(record())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"request_id": ""}, "request_id"),
        ({"verdict": "maybe"}, "maybe"),
        ({"output_len": 0}, "output_len"),
        ({"hops": -1}, "hops"),
        ({"arrival_s": -1.0}, "arrival_s"),
        ({"zero_load_ttft_s": 0.0}, "zero_load_ttft_s"),
        ({"token_times_s": (0.5,)}, "precedes arrival"),
        ({"token_times_s": (1.3, 1.2)}, "non-decreasing"),
        ({"token_times_s": (1.3, float("nan"))}, "finite"),
        ({"verdict": "rejected"}, "rejected request cannot have tokens"),
        ({"replica": ""}, "replica"),
        ({"slo": {"ttft_ms": 1}}, "slo must be an SLO"),
    ],
)
def test_invalid_records_raise(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        record(**overrides)


def edited_line(change: dict[str, Any], drop: str = "") -> str:
    data = record().to_dict()
    data.update(change)
    data.pop(drop, None)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2"),
        ("[1, 2]", "JSON object"),
        (edited_line({}, drop="verdict"), "missing field"),
        (edited_line({"first_token_s": 9.0}), "first_token_s"),
        (edited_line({"arrival_s": "soon"}), "arrival_s must be a number"),
        (edited_line({"token_times_s": 5}), "token_times_s must be a list"),
        (edited_line({"slo": {"ttft_ms": -1, "tpot_ms": 5}}), "slo.ttft_ms"),
        (edited_line({"slo": {"ttft_ms": 1}}), "slo must be an object"),
        (edited_line({"slo": {"ttft_ms": 1, "tpot_ms": 1, "stages": [{"num_tokens": 2}]}}), "tpot"),
        (edited_line({"prompt_len": 1.5}), "prompt_len"),
        (edited_line({"request_id": "r0"}), "duplicate"),
    ],
)
def test_reader_names_the_bad_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = record(request_id="r0").to_dict()
    path.write_text(json.dumps(good) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as exc:
        read_records(path)
    assert "bad.jsonl line 2" in str(exc.value)


def test_reader_skips_blank_lines_and_needs_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("\n" + json.dumps(record().to_dict()) + "\n\n")
    assert read_records(path) == [record()]
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "absent.jsonl")


def test_derived_properties() -> None:
    r = record()
    assert r.first_token_s == 1.2 and r.delivered == 3 and r.complete
    assert not record(token_times_s=(1.2,)).complete
    assert record(token_times_s=(), verdict="rejected").first_token_s is None


def test_record_for_a_generated_request_carries_its_slo_and_lengths() -> None:
    config = WorkloadConfig(zero_load_ttft_s=lambda n: 0.01 + n * 1e-4)
    first, second, *_ = generate_workload("toolllm", [0.5], config, seed=0)
    r = RequestRecord.for_request(first, verdict=Verdict.ADMITTED, token_times_s=[0.6, 0.7])
    assert (r.request_id, r.arrival_s, r.slo, r.output_len) == (
        first.request_id,
        0.5,
        first.slo,
        first.output_len,
    )
    assert r.zero_load_ttft_s == first.zero_load_ttft_s and r.slo_class == first.slo_class
    with pytest.raises(ValueError, match="pass arrival_s"):
        RequestRecord.for_request(second, verdict=Verdict.REJECTED)
    later = RequestRecord.for_request(second, verdict=Verdict.REJECTED, arrival_s=3.0, hops=2)
    assert (later.arrival_s, later.hops, later.delivered) == (3.0, 2, 0)
