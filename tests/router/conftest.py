"""A real front door for end-to-end tests: the demo pair on a local Ray cluster (2 replicas,
backup policy reject), with both doors on 127.0.0.1 and API keys required; and the demo
target's text codec."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from router.config import FrontDoorConfig
from router.local import LocalFrontDoor
from router.tokenizer import TextCodec
from tests.cluster.conftest import write_profile

API_KEY = "sk-test"
TENANT = "team-a"


@pytest.fixture(scope="session")
def codec(target_dir: Path) -> TextCodec:
    return TextCodec.from_dir(target_dir)


def demo_door(
    target_dir: Path,
    draft_dir: Path,
    tmp: Path,
    cluster: dict[str, object],
    api_keys_file: Path | None = None,
    tool_call_parser: str | None = None,
) -> FrontDoorConfig:
    """Both doors on free loopback ports over the demo pair on the synthetic profile;
    `cluster` sets the rest of the cluster config."""
    profile = str(write_profile(tmp / "profile.json"))
    base = {"model": str(target_dir), "draft": str(draft_dir), "profile": profile}
    keys = None if api_keys_file is None else str(api_keys_file)
    return FrontDoorConfig.from_args(
        {
            "cluster": {**base, **cluster},
            "http": {"port": 0},
            "grpc": {"port": 0},
            "api_keys_file": keys,
            "tool_call_parser": tool_call_parser,
        }
    )


@pytest.fixture(scope="module")
def live(
    ray_session: None, target_dir: Path, draft_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFrontDoor]:
    tmp = tmp_path_factory.mktemp("frontdoor")
    keys = tmp / "keys"
    keys.write_text(f"{API_KEY} {TENANT}\n")
    cluster = {
        "replicas": 2,
        "num_kv_blocks": 128,
        "backup_policy": "reject",
        "tiers": [{"name": "chat", "ttft_ms": 3000, "tpot_ms": 500}],
    }
    door = demo_door(target_dir, draft_dir, tmp, cluster, keys, tool_call_parser="hermes")
    with LocalFrontDoor(door) as front:
        yield front


def check_chat_thinking_apart(
    oai: openai.OpenAI,
    model: str,
    prompt: str,
    max_tokens: int,
    slo: object,
    thought: str,
    answer: str,
    stages: list[tuple[str, int]],
    reasoning_tokens: int,
) -> None:
    """A chat over HTTP, whole and streamed, gives `thought` as reasoning_content and
    `answer` as content, and counts `reasoning_tokens`; the whole one, held to `slo`,
    reports `stages` (name, tokens)."""
    messages: Any = [{"role": "user", "content": prompt}]
    whole = oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"slo": slo},
    )
    message = whole.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == (thought or None)  # null if empty
    assert message.content == answer
    verdicts = (whole.model_extra or {})["slos_serve"]["stages"]
    assert [(v["name"], v["tokens"]) for v in verdicts] == stages
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    streamed = list(
        oai.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = streamed[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
