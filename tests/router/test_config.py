"""Application args: validated before anything starts, default SLO resolution."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray

import cluster
from cluster.config import TierConfig
from replica.request import SLO, Stage
from router.app import build_app, build_front_door
from router.config import FALLBACK_SLO, FrontDoorConfig
from router.reasoning import ReasoningParser
from router.tokenizer import TextCodec

CLUSTER = {"model": "m", "spec_policy": "none"}
REASONING_TIER = {
    "name": "reasoning",
    "ttft_ms": 3000,
    "tpot_ms": 100,
    "stages": [
        {"name": "thinking", "tpot_ms": 50, "until": ":"},
        {"name": "answer", "tpot_ms": 100},
    ],
}


def test_a_tier_may_have_stages_parsed_as_a_request_s(codec: TextCodec) -> None:
    config = FrontDoorConfig.from_args(
        {"cluster": {**CLUSTER, "tiers": [REASONING_TIER]}, "default_slo": "reasoning"}
    )
    tiers, default = config.slos(codec)
    (colon,) = codec.encode(":", add_special_tokens=False)
    thinking = Stage(50, name="thinking", end_token_ids=(colon,))
    assert default == tiers["reasoning"] == SLO(3000, 100, (thinking, Stage(100, name="answer")))
    assert config.cluster.tiers[0].tightest_tpot_ms == 50
    # With stages the tier's own TPOT sets no deadline, so it bounds nothing either.
    assert TierConfig(**{**REASONING_TIER, "tpot_ms": 10}).tightest_tpot_ms == 50
    bad = {**REASONING_TIER, "stages": [{"tpot_ms": 50, "until": "</think>"}, {"tpot_ms": 100}]}
    config = FrontDoorConfig.from_args({"cluster": {**CLUSTER, "tiers": [bad]}})
    with pytest.raises(ValueError, match=r"tiers\[reasoning\]: slo.stages\[0\].until: '</think>'"):
        config.slos(codec)
    beyond = {
        **REASONING_TIER,
        "stages": [{"tpot_ms": 50, "end_token_ids": [9999]}, {"tpot_ms": 100}],
    }
    config = FrontDoorConfig.from_args({"cluster": {**CLUSTER, "tiers": [beyond]}})
    with pytest.raises(ValueError, match=r"tiers\[reasoning\]: .*9999 is outside the vocabulary"):
        config.slos(codec)


TIERS = [
    {"name": "chat", "ttft_ms": 2000, "tpot_ms": 200},
    {"name": "code", "ttft_ms": 1000, "tpot_ms": 400},
]


def test_defaults_and_default_slo(codec: TextCodec) -> None:
    config = FrontDoorConfig.from_args({"cluster": CLUSTER})
    assert (config.http_port, config.grpc_port, config.grpc_host) == (8000, 50051, None)
    assert config.slos(codec) == ({}, FALLBACK_SLO)
    tiered = {"cluster": {**CLUSTER, "tiers": TIERS}}
    assert FrontDoorConfig.from_args(tiered).slos(codec)[1] == SLO(2000, 200)
    named = FrontDoorConfig.from_args({**tiered, "default_slo": "code"})
    tiers, default = named.slos(codec)
    assert default == SLO(1000, 400) and tiers["chat"] == SLO(2000, 200)
    explicit = FrontDoorConfig.from_args({**tiered, "default_slo": {"ttft_ms": 9, "tpot_ms": 8}})
    assert explicit.slos(codec)[1] == SLO(9, 8)
    assert config.reasoning_parser is None
    thinking = FrontDoorConfig.from_args({"cluster": CLUSTER, "reasoning_parser": "deepseek_r1"})
    assert thinking.reasoning_parser == ReasoningParser("<think>", "</think>", starts_open=True)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"cluster": CLUSTER, "htp": {}}, "htp"),
        ({"cluster": CLUSTER, "http": {"port": 70000}}, "http_port"),
        ({"cluster": CLUSTER, "grpc": {"port": "x"}}, "grpc_port"),
        ({"cluster": CLUSTER, "grpc": {"prot": 1}}, "grpc"),
        ({"cluster": {**CLUSTER, "replicas": 0}}, "replicas"),
        ({"cluster": CLUSTER, "default_slo": "gold"}, "gold"),
        (
            {"cluster": {**CLUSTER, "tiers": [{**REASONING_TIER, "stages": [{"until": ":"}]}]}},
            r"tiers\[reasoning\].stages\[0\].tpot_ms must be a number",
        ),
        (
            {"cluster": {**CLUSTER, "tiers": [{**REASONING_TIER, "stages": "thinking"}]}},
            r"tiers\[reasoning\].stages must be a list",
        ),
        ({"cluster": CLUSTER, "default_slo": {"ttft_ms": 1}}, "default_slo"),
        ({"cluster": CLUSTER, "default_chat_max_tokens": 0}, "default_chat_max_tokens"),
        (
            {"cluster": CLUSTER, "default_chat_max_tokens": "256"},
            "default_chat_max_tokens must be an integer, got '256'",
        ),
        ({"cluster": CLUSTER, "max_request_mb": 0}, r"max_request_mb must be in \[0.01, 2047\]"),
        ({"cluster": [1]}, "cluster config must be a mapping, got list"),
        ({"cluster": {**CLUSTER, "tiers": None}}, "tiers must be a list of tiers, got None"),
        ({"cluster": {**CLUSTER, "route_limit": "2"}}, "route_limit must be an integer, got '2'"),
        ({"cluster": CLUSTER, "api_keys_file": 5}, "api_keys_file must be a non-empty string"),
        ({"cluster": CLUSTER, "grpc": {"host": 5}}, "grpc_host must be a non-empty string"),
        (
            {"cluster": CLUSTER, "tool_call_parser": "qwen"},
            "tool_call_parser must be one of hermes, llama3_json, pythonic or null, got 'qwen'",
        ),
        (
            {"cluster": CLUSTER, "reasoning_parser": "granite"},
            "reasoning_parser must be one of deepseek_r1, qwen3, a mapping",
        ),
        ({"cluster": CLUSTER, "reasoning_parser": {"end": ""}}, "reasoning_parser.end"),
        (
            {"cluster": CLUSTER, "tool_call_parser": ["hermes"]},
            r"tool_call_parser must be one of hermes, llama3_json, pythonic or null, "
            r"got \['hermes'\]",
        ),
    ],
)
def test_bad_args_fail_before_start(args: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_app(args)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("missing", r"api_keys_file '.*missing': No such file or directory"),
        ("keys", r"keys:1: expected `key \[tenant\]`, got 3 words"),
    ],
)
def test_the_door_reads_its_files_before_the_cluster_launches(
    target_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keys: str,
    message: str,
) -> None:
    """A missing or broken API keys file stops the start before any replica loads a model."""

    async def launch(*_: object, **__: object) -> None:
        raise AssertionError("the cluster was launched")

    monkeypatch.setattr(cluster, "launch", launch)
    (tmp_path / "keys").write_text("sk-a team-a extra\n")
    args = {
        "cluster": {"model": str(target_dir), "spec_policy": "none"},
        "api_keys_file": str(tmp_path / keys),
    }
    with pytest.raises(ValueError, match=message):
        asyncio.run(build_front_door(FrontDoorConfig.from_args(args)))


class RayStarted(Exception):
    """The launch got past its checks."""


MISSING_DRAFT = "draft: model '/nonexistent/draft' is not a folder"


@pytest.mark.parametrize(
    ("spec_policy", "raised", "match"),
    [
        ("slos", ValueError, MISSING_DRAFT),
        ("fixed:2", ValueError, MISSING_DRAFT),
        ("none", RayStarted, None),
        ("ngram", RayStarted, None),
    ],
)
def test_a_missing_draft_stops_the_launch_if_the_replicas_load_it(
    target_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    spec_policy: str,
    raised: type[Exception],
    match: str | None,
) -> None:
    """A drafting spec_policy's draft that is nowhere is refused before Ray starts, not after
    every replica loaded its target; none and ngram load no draft, so one set is not looked
    for (it may be a hub id, which would be fetched for nothing)."""

    def init(*_: object, **__: object) -> None:
        raise RayStarted

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    fields = {"model": str(target_dir), "draft": "/nonexistent/draft", "spec_policy": spec_policy}
    with pytest.raises(raised, match=match):
        asyncio.run(build_front_door(FrontDoorConfig.from_args({"cluster": fields})))
