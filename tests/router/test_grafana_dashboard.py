"""The Grafana dashboard plots exactly the metrics the front door exports (no silent drift)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cluster.api import ClusterStatus, FinalRecord, ReplicaStatus, StageVerdict, Verdict
from router.metrics import CONTROLLER_COUNTERS, FrontDoorMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def family(name: str) -> str:
    return next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)


def exported_names() -> set[str]:
    """Every series name, once each source (records, status, controller) has fed one value."""
    m = FrontDoorMetrics("demo")
    for verdict, attained in (
        (Verdict.ADMITTED, True),
        (Verdict.ADMITTED, False),
        (Verdict.BEST_EFFORT, True),
    ):
        record = FinalRecord(
            "r",
            verdict,
            replica=0,
            hops=1,
            finish_reason="stop",
            arrival_time=1.0,
            first_token_time=1.5,
            finish_time=2.0,
            num_output_tokens=2,
            stages=(StageVerdict("default", attained, 0 if attained else 1),),
        )
        m.record_final(record, "t", "x")
    m.reject("x", "bad_request")
    m.record_cancelled(record, "t", "x")
    m.record_lost(record, "t", "x")
    m.record_tokens("t", 0.0, [0.1])
    status = ClusterStatus("demo", (ReplicaStatus(0, True, 1, 1, 1, 0, 0.1),), target_replicas=1)
    hist = {"bounds": [0.01], "counts": [1], "sum": 0.001, "count": 1}
    counters = dict.fromkeys(CONTROLLER_COUNTERS, 1)
    m.refresh(status, {"counters": counters, "histograms": {"planner_latency_s": hist}})
    lines = m.exposition().decode().splitlines()
    return {line.split("{")[0].split(" ")[0] for line in lines if line and not line.startswith("#")}


def test_every_plotted_metric_is_exported_and_every_family_plotted() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    plotted = {name for e in exprs for name in re.findall(r"slos_serve:[a-z0-9_]+", e)}
    exported = exported_names()
    missing = sorted(plotted - exported)
    assert not missing, f"dashboard plots metrics nobody exports: {missing}"
    unplotted = sorted({family(n) for n in exported} - {family(n) for n in plotted})
    assert not unplotted, f"exported metrics without a panel: {unplotted}"
