"""The cluster config refuses bad values by name and loads from YAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cluster.autoscale import AutoscaleConfig, ScaleSignal
from cluster.config import BestEffortOrder, ClusterConfig, SchedulerKind, TierConfig
from cluster.controller import planner_config
from cluster.routing import BackupPolicy
from replica.planner.adaserve import AdaServeConfig
from replica.planner.config import LapsConfig


def test_yaml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: deploy/models/demo-target\n"
        "draft: deploy/models/demo-draft\n"
        "replicas: 3\n"
        "spec_policy: fixed:4\n"
        "backup_policy: reject\n"
        "tiers:\n"
        "  - {name: chat, ttft_ms: 500, tpot_ms: 50}\n"
        "  - {name: code, ttft_ms: 300, tpot_ms: 100}\n"
    )
    cfg = ClusterConfig.from_yaml(path)
    assert cfg.replicas == 3 and cfg.spec_k == 4
    assert cfg.backup_policy is BackupPolicy.REJECT
    assert cfg.tier("code") == TierConfig("code", 300, 100)
    with pytest.raises(ValueError, match="unknown tier"):
        cfg.tier("gold")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replicas", 0, "replicas"),
        ("replicas", True, "replicas"),
        ("spec_policy", "fixed:0", "spec_policy"),
        ("spec_policy", "magic", "spec_policy"),
        ("route_limit", 0, "route_limit"),
        ("backup_policy", "drop", "drop"),
        ("best_effort_order", "sjf", "best_effort_order must be one of fcfs, laps, got 'sjf'"),
        ("tick_interval_ms", 0, "tick_interval_ms"),
        ("door_lease_s", 1.0, r"door_lease_s must be in \[2, 600\], got 1.0"),
        ("door_lease_s", True, "door_lease_s"),
        ("num_kv_blocks", 0, "num_kv_blocks"),
        ("calibrate", "yes", "calibrate"),
        ("credit_prefixes", 1, "credit_prefixes must be true or false, got 1"),
        ("dtype", "fp8", "dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"),
        ("tiers", [{"name": "a", "ttft_ms": -1, "tpot_ms": 1}], "ttft_ms"),
        ("tiers", [{"name": "a", "ttft_ms": 1, "tpot_ms": float("nan")}], "tpot_ms"),
        ("tiers", [{"name": "a", "ttft_ms": 1, "tpot_ms": 1}] * 2, "unique"),
    ],
)
def test_bad_values_are_named(field: str, value: object, message: str) -> None:
    data = {"model": "m", "draft": "d", field: value}
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


@pytest.mark.parametrize(("gpus", "tp"), [(1, 4), (2, 4), (6, 4)])
def test_tensor_parallel_ranks_each_get_whole_gpus(gpus: float, tp: int) -> None:
    """tp 4 on 1 GPU was taken: Ray packed the four 0.25-GPU ranks onto one device."""
    data = {"model": "m", "draft": "d", "num_gpus_per_replica": gpus, "tensor_parallel_size": tp}
    with pytest.raises(ValueError, match=f"must be a multiple of tensor_parallel_size \\({tp}\\)"):
        ClusterConfig.from_dict(data)
    assert ClusterConfig.from_dict({**data, "num_gpus_per_replica": 8}).tensor_parallel_size == tp
    assert ClusterConfig.from_dict({**data, "num_gpus_per_replica": 0}).tensor_parallel_size == tp
    shared = {"model": "m", "draft": "d", "num_gpus_per_replica": 0.5}  # two replicas a GPU
    assert ClusterConfig.from_dict(shared).num_gpus_per_replica == 0.5


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("route_limit", 1.5, "route_limit must be an integer, got 1.5"),
        ("route_limit", True, "route_limit must be an integer, got True"),
        ("route_limit", "2", "route_limit must be an integer, got '2'"),
        ("num_kv_blocks", 10.5, "num_kv_blocks must be an integer, got 10.5"),
        ("num_kv_blocks", "1024", "num_kv_blocks must be an integer, got '1024'"),
        ("num_kv_blocks", None, "num_kv_blocks must be an integer, got None"),
        ("tensor_parallel_size", 1.5, "tensor_parallel_size must be an integer, got 1.5"),
        ("retry_after_s", NAN, "retry_after_s must be finite and >= 0, got nan"),
        ("retry_after_s", INF, "retry_after_s must be finite and >= 0, got inf"),
        ("retry_after_s", -1, "retry_after_s must be finite and >= 0, got -1"),
        ("retry_after_s", "1", "retry_after_s must be a number, got '1'"),
        ("num_cpus_per_replica", NAN, "num_cpus_per_replica must be finite and >= 0, got nan"),
        ("num_gpus_per_replica", INF, "num_gpus_per_replica must be finite and >= 0, got inf"),
        ("num_gpus_per_replica", -1, "num_gpus_per_replica must be finite and >= 0, got -1"),
        ("tick_interval_ms", "20", "tick_interval_ms must be a number, got '20'"),
        ("tick_interval_ms", 20_000, "tick_interval_ms must be in (0, 10000], got 20000"),
        ("door_lease_s", "10", "door_lease_s must be a finite number, got '10'"),
        ("model", 3, "model must be a non-empty string, got 3"),
        ("model_name", "", "model_name must be a non-empty string, got ''"),
        ("model_name", 3, "model_name must be a non-empty string, got 3"),
        ("draft", 7, "draft must be a non-empty string or null, got 7"),
        ("profile", 5, "profile must be a non-empty string or null, got 5"),
        ("tiers", None, "tiers must be a list of tiers, got None"),
        ("tiers", "chat", "tiers must be a list of tiers, got 'chat'"),
        ("tiers", [1], "tiers[0] must be a mapping of name, ttft_ms, tpot_ms, got 1"),
        (
            "tiers",
            [{"name": "a", "ttft_ms": 1, "tpot": 1}],
            "unknown tiers[0] field(s): tpot; known: name, stages, tpot_ms, ttft_ms",
        ),
        ("tiers", [{"name": 5, "ttft_ms": 1, "tpot_ms": 1}], "tiers[].name must be a non-empty "),
        ("autoscale", {"max_replicas": "4"}, "autoscale.max_replicas must be an integer, got "),
    ],
)
def test_values_of_the_wrong_type_are_named(field: str, value: object, message: str) -> None:
    """Each field checks its type, rather than failing on a comparison that names none."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        ClusterConfig.from_dict({"model": "m", "draft": "d", field: value})


def test_unknown_field_and_missing_draft() -> None:
    with pytest.raises(ValueError, match="unknown cluster config field"):
        ClusterConfig.from_dict({"model": "m", "replica": 2})
    for drafting in ("slos", "goodspeed", "specserve", "adaserve"):
        with pytest.raises(ValueError, match="needs a draft"):
            ClusterConfig(model="m", spec_policy=drafting)
    assert ClusterConfig(model="m", spec_policy="ngram").spec_k == 0


@pytest.mark.parametrize(
    ("adaserve", "spec_policy", "message"),
    [
        ({"max_width": 6}, "slos", "adaserve shapes AdaServe's token trees: set spec_policy"),
        ({"max_width": 0}, "adaserve", "adaserve.max_width must be"),
        ({"max_nodes": 2.5}, "adaserve", "adaserve.max_nodes must be"),
        (
            {"width": 6},
            "adaserve",
            "^unknown adaserve field.s.: width; known: max_nodes, max_width",
        ),
        (5, "adaserve", "adaserve must be a mapping of max_width and max_nodes, got 5"),
    ],
)
def test_bad_adaserve_constants_are_named(adaserve: object, spec_policy: str, message: str) -> None:
    data = {"model": "m", "draft": "d", "spec_policy": spec_policy, "adaserve": adaserve}
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)
    with pytest.raises(ValueError, match=message):  # built in Python, not read from YAML
        ClusterConfig(model="m", draft="d", spec_policy=spec_policy, adaserve=adaserve)  # type: ignore[arg-type]


def test_adaserve_constants_load_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\ndraft: d\nspec_policy: adaserve\nadaserve: {max_width: 6, max_nodes: 24}\n"
    )
    assert ClusterConfig.from_yaml(path).adaserve == AdaServeConfig(max_width=6, max_nodes=24)
    assert ClusterConfig(model="m", draft="d", spec_policy="adaserve").adaserve is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scheduler": "orca"}, "scheduler must be one of slos, vllm, sarathi, got 'orca'"),
        ({"scheduler": "vllm"}, "scheduler=vllm runs without speculation"),
        (
            {"scheduler": "vllm", "spec_policy": "none", "first_hop": "least_load"},
            "scheduler=vllm routes round-robin",
        ),
        ({"scheduler": "sarathi", "spec_policy": "none"}, "configure tiers"),
        ({"prefix_imbalance": -1}, "prefix_imbalance must be >= 0, got -1"),
        ({"prefix_imbalance": 1.5}, "prefix_imbalance must be an integer, got 1.5"),
        (
            {"first_hop": "prefix", "prefix_caching": False},
            "first_hop prefix routes to the replica caching a prompt's prefix: it needs "
            "prefix_caching true",
        ),
        (
            {"scheduler": "vllm", "spec_policy": "none", "best_effort_order": "laps"},
            "scheduler=vllm has no best-effort tier",
        ),
        (
            {"autoscale": {"max_replicas": 4, "target": 3}},
            "unknown autoscale field(s): target; known: downscale_delay_s, headroom",
        ),
        ({"autoscale": [1, 4]}, "autoscale must be a mapping, got [1, 4]"),
        (
            {"autoscale": {"max_replicas": 1}},
            "replicas (2) must be within autoscale's bounds [1, 1]",
        ),
        ({"autoscale": {"max_replicas": 4, "signal": "gpu"}}, "autoscale.signal must be one of"),
        (
            {"scheduler": "vllm", "spec_policy": "none", "autoscale": {"max_replicas": 4}},
            "autoscale signal slo follows admission's declines; scheduler=vllm declines nothing",
        ),
    ],
)
def test_bad_scheduler_and_autoscale_settings_are_named(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ClusterConfig.from_dict({"model": "m", "draft": "d", **overrides})


def test_autoscale_loads_from_yaml_and_sizes_the_slots(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\ndraft: d\nreplicas: 2\n"
        "autoscale: {min_replicas: 1, max_replicas: 6, signal: ongoing, "
        "target_ongoing_requests: 16}\n"
    )
    cfg = ClusterConfig.from_yaml(path)
    assert cfg.autoscale == AutoscaleConfig(
        min_replicas=1,
        max_replicas=6,
        signal=ScaleSignal.ONGOING,
        target_ongoing_requests=16.0,
    )
    assert (cfg.replicas, cfg.slots) == (2, 6)
    assert ClusterConfig(model="m", draft="d", replicas=3).slots == 3


def test_baseline_scheduler_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\n"
        "scheduler: sarathi\n"
        "spec_policy: none\n"
        "tiers:\n"
        "  - {name: chat, ttft_ms: 500, tpot_ms: 50}\n"
    )
    cfg = ClusterConfig.from_yaml(path)
    assert cfg.scheduler is SchedulerKind.SARATHI
    assert ClusterConfig(model="m", draft="d").scheduler is SchedulerKind.SLOS


def test_a_replica_computes_on_the_device_it_asked_for() -> None:
    """CPU replicas run float32 unless told otherwise; a replica given a GPU runs there, and
    one that asked for a GPU its torch cannot see says so instead of running on the CPU."""
    import torch

    from cluster.replica_actor import engine_device

    cpu = ClusterConfig.from_dict({"model": "m", "spec_policy": "none"})
    assert engine_device(cpu) == (torch.device("cpu"), torch.float32)
    bf16 = ClusterConfig.from_dict({"model": "m", "spec_policy": "none", "dtype": "bfloat16"})
    assert engine_device(bf16) == (torch.device("cpu"), torch.bfloat16)
    gpu = ClusterConfig.from_dict({"model": "m", "spec_policy": "none", "num_gpus_per_replica": 1})
    if torch.cuda.is_available():
        assert engine_device(gpu) == (torch.device("cuda"), torch.bfloat16)
    else:
        with pytest.raises(RuntimeError, match=r"num_gpus_per_replica=1, but torch .* no CUDA"):
            engine_device(gpu)


def test_best_effort_order_reaches_the_planner() -> None:
    laps = ClusterConfig(model="m", draft="d", best_effort_order="laps")
    assert laps.best_effort_order is BestEffortOrder.LAPS
    assert planner_config(laps).laps == LapsConfig()
    assert planner_config(ClusterConfig(model="m", draft="d")).laps is None
    none = ClusterConfig(model="m", spec_policy="none", best_effort_order="laps")
    assert planner_config(none).laps == LapsConfig() and planner_config(none).spec is None
