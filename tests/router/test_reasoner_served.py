"""The demo reasoning model served as deploy/serve-cpu-reasoner.yaml serves it: its thinking
comes apart from its answer at both doors, and the `reasoning` tier's thinking stage ends on
the `</think>` token the model outputs (one replica, ports free, paths from the repo root)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    start = codec.encode("<think>", add_special_tokens=False)
    assert tokens[: len(start)] == start
    between = thinking - 1 - len(start)  # the markers are not thinking
    assert result.reasoning_tokens == between

    oai = openai.OpenAI(base_url=reasoner.http_url + "/v1", api_key="-", max_retries=0)
    check_chat_thinking_apart(
        oai, "demo-reasoner", SIGNATURE, MAX_TOKENS, "reasoning", thought, answer, counts, between
    )


def test_a_think_prefill_is_thinking_and_a_reply_goes_back_as_the_sdk_gives_it(
    reasoner: LocalFrontDoor,
) -> None:
    """An assistant prefill `<think>` continued (what Qwen3-Thinking templates open) leaves
    the output inside the block: its thinking comes apart, streamed and not; the SDK's reply
    object goes back in the next turn; `include_reasoning: false` drops the thinking."""
    oai = openai.OpenAI(base_url=reasoner.http_url + "/v1", api_key="-", max_retries=0)
    messages: Any = [
        {"role": "user", "content": SIGNATURE},
        {"role": "assistant", "content": "<think>"},
    ]
    ask: Any = {
        "model": "demo-reasoner",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"add_generation_prompt": False, "continue_final_message": True},
    }
    whole = oai.chat.completions.create(messages=messages, **ask).choices[0].message
    thought = (whole.model_extra or {})["reasoning_content"]
    assert thought and whole.content and "</think>" not in whole.content
    deltas = [
        c.choices[0].delta
        for c in oai.chat.completions.create(messages=messages, stream=True, **ask)
        if c.choices
    ]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == whole.content
    hidden = {**ask, "extra_body": {**ask["extra_body"], "include_reasoning": False}}
    bare = oai.chat.completions.create(messages=messages, **hidden).choices[0].message
    assert "reasoning_content" not in (bare.model_extra or {}) and bare.content == whole.content

    turns: Any = [messages[0], whole, {"role": "user", "content": "And the median?"}]
    again = oai.chat.completions.create(
        model="demo-reasoner", messages=turns, max_tokens=8, extra_body={"reasoning_effort": "low"}
    )
    assert again.choices[0].finish_reason in ("stop", "length")
