"""The Ray Serve configs in deploy/ pass Ray's own schema and build a valid ClusterConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.autoscale import AutoscaleConfig
from cluster.config import ClusterConfig, SchedulerKind
from cluster.routing import FirstHop
from router.config import FrontDoorConfig
from router.reasoning import PARSERS
from router.tokenizer import TextCodec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GPU_BASELINES = {
    "serve-a100-opt7b-vllm.yaml": ("serve-a100-opt7b.yaml", "vllm", None),
    "serve-a100-opt7b-sarathi.yaml": ("serve-a100-opt7b.yaml", "sarathi", None),
}
GPU_CONFIGS = [
    "serve-a100-opt7b.yaml",
    *GPU_BASELINES,
    "serve-h100-llama8b.yaml",
    "serve-h100-llama70b-tp4.yaml",
]
NODRAFT_CPU = "deploy/profiles/cpu-demo-nodraft.json"
CPU_BASELINES = {
    "serve-cpu-vllm.yaml": ("serve-cpu.yaml", "vllm", NODRAFT_CPU),
    "serve-cpu-sarathi.yaml": ("serve-cpu.yaml", "sarathi", NODRAFT_CPU),
}
"""Baseline config: (the slos config it is compared with, its scheduler, its profile when it
differs: the CPU profile measured without a draft; the analytic GPU profile has none to drop)."""
ALL_CONFIGS = [
    "serve-cpu.yaml",
    "serve-cpu-specserve.yaml",
    "serve-cpu-adaserve.yaml",
    "serve-cpu-no-prefix-cache.yaml",
    "serve-cpu-no-prefix-credit.yaml",
    "serve-cpu-prefix-routing.yaml",
    "serve-cpu-autoscale.yaml",
    "serve-cpu-reasoner.yaml",
    "serve-cpu-nodraft.yaml",
    *CPU_BASELINES,
    *GPU_CONFIGS,
]


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return data


def app_args(config: dict[str, Any]) -> dict[str, Any]:
    (app,) = config["applications"]
    args: dict[str, Any] = app["args"]
    return args


def test_every_shipped_config_is_covered() -> None:
    assert sorted(p.name for p in DEPLOY.glob("serve-*.yaml")) == sorted(ALL_CONFIGS)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_config_passes_ray_schema_and_cluster_config(name: str) -> None:
    config = load(name)
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "router.app:build_app"
    assert app.route_prefix == "/"
    args = app_args(config)
    assert set(args) == {
        "cluster",
        "http",
        "grpc",
        "api_keys_file",
        "tool_call_parser",
        "reasoning_parser",
        "max_request_mb",
    }
    FrontDoorConfig.from_args(args)


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_serve_options_agree_with_application_args(name: str) -> None:
    """Ray's proxies and the front door must listen where the other expects them."""
    config = load(name)
    args = app_args(config)
    assert config["http_options"] == args["http"]
    assert config["grpc_options"] == {"port": args["grpc"]["port"]}
    assert args["http"]["port"] == 8000
    assert args["grpc"]["port"] == 50051


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_profile_exists_and_matches_tensor_parallelism(name: str) -> None:
    cfg = ClusterConfig.from_dict(app_args(load(name))["cluster"])
    assert cfg.profile is not None
    profile = json.loads((ROOT / cfg.profile).read_text())
    assert profile["tp"] == cfg.tensor_parallel_size


def test_cpu_default_serves_the_demo_pair_locally() -> None:
    config = load("serve-cpu.yaml")
    cfg = ClusterConfig.from_dict(app_args(config)["cluster"])
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert cfg.replicas == 2
    assert cfg.num_gpus_per_replica == 0
    assert cfg.draft is not None
    assert (ROOT / cfg.model / "config.json").exists()
    assert (ROOT / cfg.draft / "config.json").exists()


def test_the_reasoner_config_ends_its_thinking_stage_on_the_reasoner_s_own_token() -> None:
    """The demo reasoner runs without the draft (its vocabulary has the two markers), on the
    profile measured without one; its tier's thinking stage ends on `</think>`, one token."""
    args = app_args(load("serve-cpu-reasoner.yaml"))
    config = FrontDoorConfig.from_args(args)
    cfg = config.cluster
    assert cfg.draft is None and cfg.spec_policy == "none" and cfg.profile == NODRAFT_CPU
    assert (ROOT / cfg.model / "config.json").exists()
    codec = TextCodec.from_dir(ROOT / cfg.model)
    tiers, _ = config.slos(codec)
    thinking, answer = tiers["reasoning"].stages
    assert thinking.end_token_ids == tuple(codec.encode("</think>", add_special_tokens=False))
    assert len(thinking.end_token_ids) == 1 and not answer.end_token_ids
    assert config.reasoning_parser is PARSERS["qwen3"]


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("serve-cpu-specserve.yaml", {"spec_policy": "specserve"}),
        ("serve-cpu-adaserve.yaml", {"spec_policy": "adaserve"}),
        ("serve-cpu-no-prefix-cache.yaml", {"prefix_caching": False}),
        ("serve-cpu-no-prefix-credit.yaml", {"credit_prefixes": False}),
        ("serve-cpu-prefix-routing.yaml", {"first_hop": FirstHop.PREFIX}),
        (
            "serve-cpu-nodraft.yaml",
            {"draft": None, "spec_policy": "none", "profile": NODRAFT_CPU},
        ),
        (
            "serve-cpu-autoscale.yaml",
            {"replicas": 1, "autoscale": AutoscaleConfig(min_replicas=1, max_replicas=2)},
        ),
    ],
)
def test_a_variant_config_differs_from_the_default_in_its_one_field(
    name: str, change: dict[str, object]
) -> None:
    config, default = load(name), load("serve-cpu.yaml")
    cfg = ClusterConfig.from_dict(app_args(config)["cluster"])
    slos = ClusterConfig.from_dict(app_args(default)["cluster"])
    assert cfg == dataclasses.replace(slos, **change)  # type: ignore[arg-type]
    assert {k: v for k, v in config.items() if k != "applications"} == {
        k: v for k, v in default.items() if k != "applications"
    }
    assert {k: v for k, v in app_args(config).items() if k != "cluster"} == {
        k: v for k, v in app_args(default).items() if k != "cluster"
    }


@pytest.mark.parametrize(("name", "compared"), {**CPU_BASELINES, **GPU_BASELINES}.items())
def test_baseline_differs_from_its_slos_config_in_its_scheduler_only(
    name: str, compared: tuple[str, str, str | None]
) -> None:
    """A capacity comparison must change the scheduler and nothing else (the baselines do
    not speculate, so they load no draft, and on CPU plan with the profile of an engine
    without one: a draft model prefills every prompt alongside the target)."""
    slos_name, scheduler, profile = compared
    config = load(name)
    default = load(slos_name)
    cfg = ClusterConfig.from_dict(app_args(config)["cluster"])
    slos = ClusterConfig.from_dict(app_args(default)["cluster"])
    assert slos.scheduler is SchedulerKind.SLOS
    assert cfg == dataclasses.replace(
        slos,
        scheduler=SchedulerKind(scheduler),
        spec_policy="none",
        draft=None,
        profile=profile or slos.profile,
    )
    assert {k: v for k, v in config.items() if k != "applications"} == {
        k: v for k, v in default.items() if k != "applications"
    }
    assert {k: v for k, v in app_args(config).items() if k != "cluster"} == {
        k: v for k, v in app_args(default).items() if k != "cluster"
    }


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_gives_each_replica_its_tensor_parallel_gpus(name: str) -> None:
    config = load(name)
    cfg = ClusterConfig.from_dict(app_args(config)["cluster"])
    assert config["http_options"]["host"] == "0.0.0.0"
    assert (cfg.draft is None) == (name in GPU_BASELINES)
    assert cfg.num_gpus_per_replica == cfg.tensor_parallel_size
    assert 8 % cfg.tensor_parallel_size == 0
