"""Loading the Azure LLM inference traces (2023): arrival times with prompt and output lengths.

The traces are production request logs of two Azure LLM services, the arrival patterns the
SLOs-Serve paper evaluates on: coding (bursty) and conversation (steady). They are not in the
repository; the path is always a parameter. Data: Azure/AzurePublicDataset, CC-BY 4.0, from
Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.
Keep AZURE_ATTRIBUTION next to any result derived from them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TextIO

AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (Azure/AzurePublicDataset, CC-BY 4.0); Patel et al., "
    '"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024'
)
AZURE_CODE_FILE = "AzureLLMInferenceTrace_code.csv"
"""Coding service: bursty arrivals (inter-arrival coefficient of variation ~13)."""
AZURE_CONV_FILE = "AzureLLMInferenceTrace_conv.csv"
"""Conversation service: steady arrivals (inter-arrival coefficient of variation ~1.1)."""
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TraceRow:
    """One logged request: seconds since the trace's first request, and its token counts."""

    time_s: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Trace:
    """A whole trace, rows in arrival order, times starting at 0."""

    name: str
    rows: tuple[TraceRow, ...]
    attribution: str = AZURE_ATTRIBUTION
    """Whose data it is ("" for a trace of your own: no attribution to keep)."""

    def __post_init__(self) -> None:
        if len(self.rows) < 2:
            raise ValueError(f"trace {self.name!r} needs at least 2 rows, got {len(self.rows)}")
        if self.duration_s <= 0:
            raise ValueError(f"trace {self.name!r} spans no time: all rows share one timestamp")

    @property
    def duration_s(self) -> float:
        return self.rows[-1].time_s - self.rows[0].time_s

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace: the n-1 gaps between n arrivals span duration_s."""
        return (len(self.rows) - 1) / self.duration_s

    def times(self) -> list[float]:
        return [r.time_s for r in self.rows]


def _parse_time(text: str, where: str) -> datetime:
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{where}: TIMESTAMP {text!r} is not an ISO date-time") from None


def _parse_count(text: str, column: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{where}: {column} {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{where}: {column} must be >= 0, got {value}")
    return value


def load_trace(path: str | Path) -> Trace:
    """Parse a trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens; extra columns ignored):
    one of the Azure files, or a log of your own in their format.

    Rows must be in non-decreasing time order, as the published files are: a shuffled file is
    more likely a different format than a trace to sort.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace file {str(path)!r} is a directory")
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # a BOM, as Excel saves CSV
            return _read_trace(path, f)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path.name}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def _read_trace(path: Path, f: TextIO) -> Trace:
    """The trace in `f`, the file at `path` open."""
    reader = csv.DictReader(f)
    if reader.fieldnames is None:
        raise ValueError(f"{path.name} is empty: give a header ({', '.join(COLUMNS)}) and rows")
    header = [h.strip() for h in reader.fieldnames]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path.name}: missing column(s) {missing}; header is {header}")
    reader.fieldnames = header
    rows: list[TraceRow] = []
    start: datetime | None = None
    for line, raw in enumerate(reader, start=2):
        where = f"{path.name} line {line}"
        if any(raw.get(c) is None for c in COLUMNS):
            raise ValueError(f"{where}: expected {len(header)} fields, got fewer")
        stamp = _parse_time(raw["TIMESTAMP"], where)
        start = stamp if start is None else start
        if (stamp.tzinfo is None) != (start.tzinfo is None):
            raise ValueError(
                f"{where}: TIMESTAMP {raw['TIMESTAMP']!r} mixes time zones: give every row "
                f"an offset, or none"
            )
        t = (stamp - start).total_seconds()
        if rows and t < rows[-1].time_s:
            raise ValueError(f"{where}: timestamp goes back in time ({raw['TIMESTAMP']})")
        rows.append(
            TraceRow(
                time_s=t,
                context_tokens=_parse_count(raw["ContextTokens"], "ContextTokens", where),
                generated_tokens=_parse_count(raw["GeneratedTokens"], "GeneratedTokens", where),
            )
        )
    azure = path.name in (AZURE_CODE_FILE, AZURE_CONV_FILE)
    return Trace(name=path.stem, rows=tuple(rows), attribution=AZURE_ATTRIBUTION if azure else "")


@cache
def read_trace(path: Path) -> Trace:
    """`load_trace`, once per process and path: a capacity search replays a trace at every
    point, and a mix file's own trace is read when the mix is checked and again to replay."""
    return load_trace(path)
