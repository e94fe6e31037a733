"""The demo reasoning model served as deploy/serve-cpu-reasoner.yaml serves it: its thinking
comes apart from its answer at both doors, and the `reasoning` tier's thinking stage ends on
the `</think>` token the model outputs (one replica, ports free, paths from the repo root)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from router.client import Chunk, Client, Result
from router.config import FrontDoorConfig
from router.local import LocalFrontDoor
from router.tokenizer import TextCodec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SIGNATURE = "def mean(data):"
MAX_TOKENS = 160


def shipped_args() -> dict[str, Any]:
    config = yaml.safe_load((ROOT / "deploy" / "serve-cpu-reasoner.yaml").read_text())
    args: dict[str, Any] = config["applications"][0]["args"]
    return args


@pytest.fixture(scope="module")
def reasoner(ray_session: None) -> Iterator[LocalFrontDoor]:
    args = shipped_args()
    cluster = args["cluster"] | {
        "model": str(ROOT / args["cluster"]["model"]),
        "profile": str(ROOT / args["cluster"]["profile"]),
        "replicas": 1,
        "num_kv_blocks": 256,
    }
    door = FrontDoorConfig.from_args(
        args | {"cluster": cluster, "http": {"port": 0}, "grpc": {"port": 0}}
    )
    with LocalFrontDoor(door) as front:
        yield front


def test_the_reasoner_thinks_apart_and_its_thinking_stage_ends_on_its_token(
    reasoner: LocalFrontDoor, reasoner_dir: Path
) -> None:
    codec = TextCodec.from_dir(reasoner_dir)
    (end,) = codec.encode("</think>", add_special_tokens=False)
    with Client(reasoner.grpc_target) as client:
        items = list(
            client.generate(
                messages=[("user", SIGNATURE)],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                slo="reasoning",
            )
        )
    chunks = [c for c in items if isinstance(c, Chunk)]
    (result,) = [r for r in items if isinstance(r, Result)]
    tokens = [t for c in chunks for t in c.token_ids]
    assert end in tokens, codec.decode(tokens)
    thinking = tokens.index(end) + 1
    thought = "".join(c.reasoning for c in chunks)
    answer = "".join(c.text for c in chunks)
    assert codec.decode(tokens) == f"<think>{thought}</think>{answer}"
    assert thought.strip() and answer.strip()
    assert [(s.name, s.tokens) for s in result.stages] == [
        ("thinking", thinking),
        ("answer", len(tokens) - thinking),
    ]

    oai = openai.OpenAI(base_url=reasoner.http_url + "/v1", api_key="-", max_retries=0)
    messages: Any = [{"role": "user", "content": SIGNATURE}]
    whole = oai.chat.completions.create(
        model="demo-reasoner",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"slo": "reasoning"},
    )
    message = whole.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] == thought
    assert message.content == answer
    stages = (whole.model_extra or {})["slos_serve"]["stages"]
    assert [(s["name"], s["tokens"]) for s in stages] == [
        ("thinking", thinking),
        ("answer", len(tokens) - thinking),
    ]
    streamed = oai.chat.completions.create(
        model="demo-reasoner",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
