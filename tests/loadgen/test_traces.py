"""Trace loading: parsing, clear errors on malformed files, and the real Azure files if present."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.arrivals import interarrival_cv
from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE, load_trace

AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-inference-2023"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(header + body)
    return path


def test_parses_times_relative_to_first_row(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.4799600,3180,8\n"
        "2023-11-16 18:17:05.9799600,110,27\n",
    )
    trace = load_trace(path)
    assert trace.name == "trace"
    assert trace.times() == pytest.approx([0.0, 0.5, 2.0])
    assert [r.context_tokens for r in trace.rows] == [4808, 3180, 110]
    assert [r.generated_tokens for r in trace.rows] == [10, 8, 27]
    assert trace.duration_s == pytest.approx(2.0)
    assert trace.mean_rate == pytest.approx(1.0)
    assert trace.attribution == ""  # a log of your own: no one's data to credit


def test_the_azure_files_carry_their_attribution(tmp_path: Path) -> None:
    for name in (AZURE_CODE_FILE, AZURE_CONV_FILE):
        path = tmp_path / name
        path.write_text(HEADER + "2023-11-16 18:17:03,10,1\n2023-11-16 18:17:04,20,2\n")
        assert "CC-BY 4.0" in load_trace(path).attribution


def test_column_order_and_extra_columns_do_not_matter(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "7,5,2023-11-16 18:00:00,x\n9,6,2023-11-16 18:00:02,y\n",
        header="GeneratedTokens,ContextTokens,TIMESTAMP,Note\n",
    )
    trace = load_trace(path)
    assert [(r.context_tokens, r.generated_tokens) for r in trace.rows] == [(5, 7), (6, 9)]


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        ("2023-11-16 18:00:00,1,2\n", "TIMESTAMP,ContextTokens\n", "missing column"),
        ("yesterday,1,2\n2023-11-16 18:00:00,1,2\n", HEADER, "line 2: TIMESTAMP"),
        ("2023-11-16 18:00:00,1,2\n2023-11-16 18:00:01,x,2\n", HEADER, "line 3: ContextTokens"),
        ("2023-11-16 18:00:00,1,-2\n2023-11-16 18:00:01,1,2\n", HEADER, "GeneratedTokens must"),
        ("2023-11-16 18:00:05,1,2\n2023-11-16 18:00:01,1,2\n", HEADER, "back in time"),
        ("2023-11-16 18:00:00,1,2\n2023-11-16 18:00:01,1\n", HEADER, "line 3: expected 3"),
        ("2023-11-16 18:00:00,1,2\n", HEADER, "at least 2 rows"),
        ("2023-11-16 18:00:00,1,2\n2023-11-16 18:00:00,1,2\n", HEADER, "spans no time"),
        ("", "", "is empty: give a header"),
        ("2023-11-16 18:00:00,1,2\n2023-11-16 18:20:00+00:00,1,2\n", HEADER, "mixes time zones"),
    ],
)
def test_malformed_files_name_the_problem(
    tmp_path: Path, body: str, header: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_trace(write(tmp_path, body, header))


def test_a_byte_order_mark_is_no_column_and_bytes_that_are_no_text_are_named(
    tmp_path: Path,
) -> None:
    """Sizing QA: a CSV saved by Excel (UTF-8 with a BOM) lacked its TIMESTAMP column, and
    bytes that are no UTF-8 gave the decoder's message without the file's name."""
    bom = tmp_path / "excel.csv"
    bom.write_text(HEADER + "2023-11-16 18:00:00,1,2\n2023-11-16 18:00:01,3,4\n", "utf-8-sig")
    assert [r.context_tokens for r in load_trace(bom).rows] == [1, 3]
    junk = tmp_path / "junk.csv"
    junk.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match=r"junk.csv: not UTF-8 text"):
        load_trace(junk)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "absent.csv")
    with pytest.raises(ValueError, match="is a directory"):
        load_trace(tmp_path)


@pytest.mark.parametrize(
    ("name", "rows", "rate", "cv_low", "cv_high"),
    [(AZURE_CODE_FILE, 8819, 2.57, 5.0, 30.0), (AZURE_CONV_FILE, 19366, 5.53, 0.8, 1.5)],
)
def test_real_azure_traces(
    name: str, rows: int, rate: float, cv_low: float, cv_high: float
) -> None:
    path = AZURE_DIR / name
    if not path.is_file():
        pytest.skip(f"Azure trace not available at {path} (the data is not in the repository)")
    trace = load_trace(path)
    assert len(trace.rows) == rows
    assert trace.mean_rate == pytest.approx(rate, rel=0.01)
    assert cv_low < interarrival_cv(trace.times()) < cv_high
    assert all(r.context_tokens > 0 and r.generated_tokens > 0 for r in trace.rows)
