"""Per-request measurement records, one JSON object per line (JSONL).

A record holds what the client saw (arrival, every token's time) and what the system decided
(verdict, replica, routing hops), plus the SLO and zero-load TTFT it is judged against, so a
results file can be re-scored without the run. Times are seconds on the run's clock. Several
tokens may share one time (speculative decoding delivers them together).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from loadgen.workloads import WorkloadRequest
from replica.request import SLO, Stage


class Verdict(StrEnum):
    """What admission decided for the request."""

    ADMITTED = "admitted"
    BEST_EFFORT = "best_effort"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    """The client never heard it: it closed the stream at output_len before the server's final
    report, or the request failed (see `error`)."""


@dataclass(frozen=True)
class RequestRecord:
    """One request's outcome as measured by the client."""

    request_id: str
    scenario: str
    slo_class: str
    arrival_s: float
    prompt_len: int
    output_len: int
    """Tokens the request was meant to produce (its true length); fewer delivered = incomplete."""
    slo: SLO
    zero_load_ttft_s: float
    verdict: Verdict
    token_times_s: tuple[float, ...] = ()
    """When each output token reached the client, in order."""
    replica: str | None = None
    hops: int = 0
    """Replicas that declined the request before the final one (0 = first choice)."""
    error: str | None = None
    """Why the request failed or was refused, as the server or the transport said it."""

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        object.__setattr__(self, "verdict", Verdict(self.verdict))
        object.__setattr__(self, "token_times_s", tuple(float(t) for t in self.token_times_s))
        if not isinstance(self.slo, SLO):
            raise ValueError(f"{rid}: slo must be an SLO, got {type(self.slo).__name__}")
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{rid}: {name} must be an integer >= 1, got {value!r}")
        if isinstance(self.hops, bool) or not isinstance(self.hops, int) or self.hops < 0:
            raise ValueError(f"{rid}: hops must be an integer >= 0, got {self.hops!r}")
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"{rid}: arrival_s must be finite and >= 0, got {self.arrival_s!r}")
        zero = self.zero_load_ttft_s
        if not math.isfinite(zero) or zero <= 0:
            raise ValueError(f"{rid}: zero_load_ttft_s must be finite and > 0, got {zero!r}")
        times = self.token_times_s
        if any(not math.isfinite(t) for t in times):
            raise ValueError(f"{rid}: token times must be finite")
        if times and times[0] < self.arrival_s:
            raise ValueError(f"{rid}: first token at {times[0]} precedes arrival {self.arrival_s}")
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError(f"{rid}: token times must be non-decreasing")
        if self.verdict is Verdict.REJECTED and times:
            raise ValueError(f"{rid}: a rejected request cannot have tokens")
        if self.replica is not None and (not isinstance(self.replica, str) or not self.replica):
            raise ValueError(f"{rid}: replica must be a non-empty string or null")
        if self.error is not None and not isinstance(self.error, str):
            raise ValueError(f"{rid}: error must be a string or null, got {self.error!r}")

    @classmethod
    def for_request(
        cls,
        request: WorkloadRequest,
        *,
        verdict: Verdict,
        token_times_s: Sequence[float] = (),
        arrival_s: float | None = None,
        replica: str | None = None,
        hops: int = 0,
        error: str | None = None,
    ) -> RequestRecord:
        """The record of a generated request; arrival_s is needed for follow-up rounds, whose
        real arrival is known only at run time."""
        if arrival_s is None:
            if request.follows is not None:
                raise ValueError(f"{request.request_id} follows {request.follows}: pass arrival_s")
            arrival_s = request.arrival_s
        return cls(
            request_id=request.request_id,
            scenario=request.scenario,
            slo_class=request.slo_class,
            arrival_s=arrival_s,
            prompt_len=request.prompt_len,
            output_len=request.output_len,
            slo=request.judged_slo,
            zero_load_ttft_s=request.zero_load_ttft_s,
            verdict=verdict,
            token_times_s=tuple(token_times_s),
            replica=replica,
            hops=hops,
            error=error,
        )

    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def delivered(self) -> int:
        return len(self.token_times_s)

    @property
    def complete(self) -> bool:
        return self.delivered >= self.output_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "scenario": self.scenario,
            "slo_class": self.slo_class,
            "arrival_s": self.arrival_s,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "slo": slo_to_dict(self.slo),
            "zero_load_ttft_s": self.zero_load_ttft_s,
            "verdict": self.verdict.value,
            "replica": self.replica,
            "hops": self.hops,
            "error": self.error,
            "first_token_s": self.first_token_s,
            "token_times_s": list(self.token_times_s),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        if not isinstance(data, dict):
            raise ValueError(f"a record must be a JSON object, got {type(data).__name__}")
        required = (
            "request_id",
            "scenario",
            "slo_class",
            "arrival_s",
            "prompt_len",
            "output_len",
            "slo",
            "zero_load_ttft_s",
            "verdict",
        )
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"record is missing field(s) {missing}")
        times = data.get("token_times_s", [])
        if not isinstance(times, list):
            raise ValueError("token_times_s must be a list of numbers")
        record = cls(
            request_id=data["request_id"],
            scenario=str(data["scenario"]),
            slo_class=str(data["slo_class"]),
            arrival_s=_number(data["arrival_s"], "arrival_s"),
            prompt_len=data["prompt_len"],
            output_len=data["output_len"],
            slo=slo_from_dict(data["slo"]),
            zero_load_ttft_s=_number(data["zero_load_ttft_s"], "zero_load_ttft_s"),
            verdict=_verdict(data["verdict"]),
            token_times_s=tuple(_number(t, "token_times_s[]") for t in times),
            replica=data.get("replica"),
            hops=data.get("hops", 0),
            error=data.get("error"),
        )
        first = data.get("first_token_s")
        if first != record.first_token_s:
            raise ValueError(
                f"{record.request_id}: first_token_s={first!r} disagrees with token_times_s"
            )
        return record


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _verdict(value: Any) -> Verdict:
    try:
        return Verdict(value)
    except ValueError:
        known = [v.value for v in Verdict]
        raise ValueError(f"verdict must be one of {known}, got {value!r}") from None


def slo_to_dict(slo: SLO) -> dict[str, Any]:
    return {
        "ttft_ms": slo.ttft_ms,
        "tpot_ms": slo.tpot_ms,
        "stages": [
            {
                "tpot_ms": s.tpot_ms,
                "num_tokens": s.num_tokens,
                "ttft_ms": s.ttft_ms,
                "name": s.name,
                **({"end_token_ids": list(s.end_token_ids)} if s.end_token_ids else {}),
            }
            for s in slo.stages
        ],
    }


def slo_from_dict(data: Any) -> SLO:
    if not isinstance(data, dict) or "ttft_ms" not in data or "tpot_ms" not in data:
        raise ValueError(f"slo must be an object with ttft_ms and tpot_ms, got {data!r}")
    stages = data.get("stages", [])
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        raise ValueError(f"slo.stages must be a list of objects, got {stages!r}")
    return SLO(
        ttft_ms=data["ttft_ms"],
        tpot_ms=data["tpot_ms"],
        stages=tuple(
            Stage(
                tpot_ms=s.get("tpot_ms"),
                num_tokens=s.get("num_tokens"),
                ttft_ms=s.get("ttft_ms"),
                name=str(s.get("name", "")),
                end_token_ids=s.get("end_token_ids", ()),
            )
            for s in stages
        ),
    )


class RecordWriter:
    """Appends records as requests finish, one flushed line each, so a crash keeps what ran."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self._ids: set[str] = set()

    def write(self, record: RequestRecord) -> None:
        if record.request_id in self._ids:
            raise ValueError(f"duplicate record for request {record.request_id!r}")
        self._ids.add(record.request_id)
        self._file.write(json.dumps(record.to_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> None:
    with RecordWriter(path) as writer:
        for record in records:
            writer.write(record)


def iter_records(path: str | Path) -> Iterator[RequestRecord]:
    """Records in file order; a bad line raises ValueError naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"records file {str(path)!r} does not exist")
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = RequestRecord.from_dict(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path.name} line {line_no}: {exc}") from None
            if record.request_id in seen:
                raise ValueError(f"{path.name} line {line_no}: duplicate {record.request_id!r}")
            seen.add(record.request_id)
            yield record


def read_records(path: str | Path) -> list[RequestRecord]:
    return list(iter_records(path))
