"""The demo reasoning model served as deploy/serve-cpu-reasoner.yaml serves it: its thinking
comes apart from its answer at both doors, and the `reasoning` tier's thinking stage ends on
the `</think>` token the model outputs (one replica, ports free, paths from the repo root)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from router.client import Chunk, Client, Result
from router.config import FrontDoorConfig
from router.local import LocalFrontDoor
from router.tokenizer import TextCodec
from tests.deploy.test_serve_configs import ROOT, app_args, load
from tests.router.conftest import check_chat_thinking_apart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SIGNATURE = "def mean(data):"
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def reasoner(ray_session: None, reasoner_dir: Path) -> Iterator[LocalFrontDoor]:
    args = app_args(load("serve-cpu-reasoner.yaml"))
    cluster = args["cluster"] | {
        "model": str(reasoner_dir),
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
    counts = [("thinking", thinking), ("answer", len(tokens) - thinking)]
    assert [(s.name, s.tokens) for s in result.stages] == counts

    oai = openai.OpenAI(base_url=reasoner.http_url + "/v1", api_key="-", max_retries=0)
    check_chat_thinking_apart(
        oai, "demo-reasoner", SIGNATURE, MAX_TOKENS, "reasoning", thought, answer, counts
    )
