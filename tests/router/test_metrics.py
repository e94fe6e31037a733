"""Exposition parses, and every count equals what the records fed in say (no double counting)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.api import ClusterStatus, FinalRecord, ReplicaStatus, StageVerdict, Verdict
from router.metrics import CONTROLLER_COUNTERS, MAX_STAGE_LABELS, PREFIX, FrontDoorMetrics


def samples(metrics: FrontDoorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def record(verdict: Verdict, hops: int, stages: tuple[StageVerdict, ...] = ()) -> FinalRecord:
    served = verdict is not Verdict.REJECTED
    return FinalRecord(
        request_id="r",
        verdict=verdict,
        replica=0 if served else None,
        hops=hops,
        finish_reason="length" if served else None,
        arrival_time=10.0,
        first_token_time=10.5 if served else None,
        finish_time=12.0 if served else None,
        num_prompt_tokens=5,
        num_output_tokens=4 if served else 0,
        stages=stages,
    )


def test_client_chosen_stage_names_are_capped_as_labels() -> None:
    m = FrontDoorMetrics("demo")
    for i in range(MAX_STAGE_LABELS + 5):
        m.record_final(record(Verdict.ADMITTED, 1, (StageVerdict(f"s{i}", True, 0),)), "c", "t")
    stages = {
        labels[1][1] for (name, labels) in samples(m) if name == PREFIX + "slo_attained_total"
    }
    assert len(stages) == MAX_STAGE_LABELS + 1 and "other" in stages


def test_counts_match_records_fed() -> None:
    m = FrontDoorMetrics("demo")
    met = (StageVerdict("think", True, 0), StageVerdict("answer", False, 2))
    m.record_final(record(Verdict.ADMITTED, 1, met), "chat", "team-a")
    m.record_final(record(Verdict.ADMITTED, 2, met), "chat", "team-a")
    m.record_final(record(Verdict.BEST_EFFORT, 2), "flex", "team-b")
    m.record_final(record(Verdict.REJECTED, 2), "chat", "team-a")
    m.reject("team-b", "bad_request")
    m.record_tokens("chat", None, [1.0, 1.1, 1.3])
    m.record_tokens("chat", 1.3, [1.6])
    s = samples(m)
    admitted = (("model", "demo"), ("tenant", "team-a"))
    assert s[(PREFIX + "requests_admitted_total", admitted)] == 2
    best = (("model", "demo"), ("tenant", "team-b"))
    assert s[(PREFIX + "requests_best_effort_total", best)] == 1
    rejected = (("model", "demo"), ("reason", "backup_policy"), ("tenant", "team-a"))
    assert s[(PREFIX + "requests_rejected_total", rejected)] == 1
    bad = (("model", "demo"), ("reason", "bad_request"), ("tenant", "team-b"))
    assert s[(PREFIX + "requests_rejected_total", bad)] == 1
    # Left after its first token, waiting for a second it was due by then: its route, first
    # token and stage count, though it has no end.
    waited = (StageVerdict("think", False, 0, 1),)
    left = replace(record(Verdict.ADMITTED, 3, waited), finish_time=None, num_output_tokens=1)
    m.record_cancelled(left, "chat", "team-a")
    m.record_cancelled(None, "chat", "team-a")  # left before the cluster's first answer
    s = samples(m)
    assert s[(PREFIX + "requests_admitted_total", admitted)] == 3
    cancelled = (("model", "demo"), ("tenant", "team-a"), ("verdict", "admitted"))
    assert s[(PREFIX + "requests_cancelled_total", cancelled)] == 1
    unknown = (("model", "demo"), ("tenant", "team-a"), ("verdict", "unknown"))
    assert s[(PREFIX + "requests_cancelled_total", unknown)] == 1
    cut = replace(
        record(Verdict.BEST_EFFORT, 1), first_token_time=None, finish_time=None, num_output_tokens=0
    )
    m.record_lost(cut, "flex", "team-b")  # cut off before its first token
    s = samples(m)
    assert s[(PREFIX + "requests_best_effort_total", best)] == 2
    lost = (("model", "demo"), ("tenant", "team-b"), ("verdict", "best_effort"))
    assert s[(PREFIX + "requests_lost_total", lost)] == 1
    think = (("model", "demo"), ("stage", "think"), ("tier", "chat"))
    answer = (("model", "demo"), ("stage", "answer"), ("tier", "chat"))
    assert s[(PREFIX + "slo_attained_total", think)] == 2
    assert s[(PREFIX + "slo_violated_total", think)] == 1
    assert s[(PREFIX + "slo_violated_total", answer)] == 2
    chat = (("model", "demo"), ("tier", "chat"))
    assert s[(PREFIX + "time_to_first_token_seconds_count", chat)] == 3
    assert s[(PREFIX + "time_to_first_token_seconds_sum", chat)] == 1.5
    assert s[(PREFIX + "e2e_request_latency_seconds_count", chat)] == 2
    assert s[(PREFIX + "e2e_request_latency_seconds_sum", chat)] == 4.0
    assert s[(PREFIX + "inter_token_latency_seconds_count", chat)] == 3
    assert abs(s[(PREFIX + "inter_token_latency_seconds_sum", chat)] - 0.6) < 1e-9
    flex = (("model", "demo"), ("tier", "flex"))
    assert s[(PREFIX + "time_to_first_token_seconds_count", flex)] == 1
    assert s[(PREFIX + "route_hops_count", (("model", "demo"),))] == 6
    # 5 prompt tokens each: team-a's two finished and the one left (after 1 token of its
    # own), team-b's finished one (4 tokens) and the one cut off (none).
    assert s[(PREFIX + "prompt_tokens_total", admitted)] == 3 * 5
    assert s[(PREFIX + "generation_tokens_total", admitted)] == 4 + 4 + 1
    assert s[(PREFIX + "prompt_tokens_total", best)] == 2 * 5
    assert s[(PREFIX + "generation_tokens_total", best)] == 4
    assert s[(PREFIX + "route_hops_sum", (("model", "demo"),))] == 11
    by_reason = (("finish_reason", "length"), ("model", "demo"))
    assert s[(PREFIX + "requests_finished_total", (*by_reason, ("tenant", "team-a")))] == 2
    assert s[(PREFIX + "requests_finished_total", (*by_reason, ("tenant", "team-b")))] == 1


def test_cluster_snapshot_is_replaced_not_summed() -> None:
    m = FrontDoorMetrics("demo")
    replicas = (
        ReplicaStatus(0, True, running=3, waiting=1, admitted=3, best_effort=0, kv_usage=0.5),
        ReplicaStatus(1, False, running=9, waiting=9, admitted=0, best_effort=0, kv_usage=0.9),
    )
    snapshot = {
        "counters": {
            "spec_draft_tokens": 40,
            "spec_accepted_tokens": 25,
            "admitted": 7,
            "steps": 300,
            "busy_us": 2_500_000,
            "preempted": 2,
            "preempted_tokens": 48,
            "demoted": 3,
            "promoted": 2,
            "prefix_cache_queries": 900,
            "prefix_cache_hits": 640,
        },
        "histograms": {
            "planner_latency_s": {
                "bounds": [0.001, 0.01],
                "counts": [2, 3],
                "sum": 0.02,
                "count": 4,
            }
        },
    }
    for _ in range(3):
        m.refresh(ClusterStatus("demo", replicas), snapshot)
        s = samples(m)
    r0 = (("model", "demo"), ("replica", "0"))
    r1 = (("model", "demo"), ("replica", "1"))
    assert s[(PREFIX + "num_requests_running", r0)] == 3
    assert s[(PREFIX + "num_requests_waiting", r0)] == 1
    assert s[(PREFIX + "kv_cache_usage_perc", r0)] == 0.5
    assert (PREFIX + "num_requests_running", r1) not in s
    assert s[(PREFIX + "replica_up", r1)] == 0
    model = (("model", "demo"),)
    assert s[(PREFIX + "spec_decode_num_draft_tokens_total", model)] == 40
    assert s[(PREFIX + "spec_decode_num_accepted_tokens_total", model)] == 25
    assert s[(PREFIX + "replica_steps_total", model)] == 300
    assert s[(PREFIX + "replica_busy_seconds_total", model)] == 2.5
    assert s[(PREFIX + "requests_demoted_total", model)] == 3
    assert s[(PREFIX + "requests_promoted_total", model)] == 2
    assert s[(PREFIX + "num_preemptions_total", model)] == 2
    assert s[(PREFIX + "preempted_tokens_total", model)] == 48
    assert s[(PREFIX + "prefix_cache_queries_total", model)] == 900
    assert s[(PREFIX + "prefix_cache_hits_total", model)] == 640
    assert s[(PREFIX + "planner_latency_seconds_count", model)] == 4
    inf = (("le", "+Inf"), ("model", "demo"))
    assert s[(PREFIX + "planner_latency_seconds_bucket", inf)] == 4


def test_replica_states_follow_the_autoscaler() -> None:
    m = FrontDoorMetrics("demo")
    replicas = (
        ReplicaStatus(0, True, running=1, waiting=0, admitted=1, best_effort=0, kv_usage=0.1),
        ReplicaStatus(2, True, 1, 0, 0, 1, 0.2, draining=True),
    )
    m.refresh(
        ClusterStatus("demo", replicas, target_replicas=3, starting=2),
        {"counters": {"declined": 5}},
    )
    s = samples(m)

    def state(name: str) -> tuple[tuple[str, str], ...]:
        return (("model", "demo"), ("state", name))

    assert s[(PREFIX + "num_replicas", state("serving"))] == 1
    assert s[(PREFIX + "num_replicas", state("draining"))] == 1
    assert s[(PREFIX + "num_replicas", state("starting"))] == 2
    model = (("model", "demo"),)
    assert s[(PREFIX + "replicas_target", model)] == 3
    assert s[(PREFIX + "requests_declined_total", model)] == 5
    m.refresh(ClusterStatus("demo", replicas[:1]), {"counters": {}})
    assert (PREFIX + "replicas_target", model) not in samples(m)


def test_controller_counters_are_exported_from_zero() -> None:
    """Every controller counter has a sample once the door has the controller's snapshot,
    0 before its first event (a fresh server's /metrics showed none of them, so a user could
    not find them and rate() had no start); none before any snapshot."""
    m = FrontDoorMetrics("demo")
    model = (("model", "demo"),)
    names = [PREFIX + name + "_total" for name, _, _ in CONTROLLER_COUNTERS.values()]
    assert not any((name, model) in samples(m) for name in names)
    m.refresh(ClusterStatus("demo", ()), {"counters": {"migrated": 2}})
    s = samples(m)
    assert s[(PREFIX + "requests_migrated_total", model)] == 2
    assert {s[(name, model)] for name in names if "migrated" not in name} == {0}


def test_unknown_reject_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="bored"):
        FrontDoorMetrics("demo").reject("t", "bored")
