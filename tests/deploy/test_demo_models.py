"""The shipped demo pair and reasoner: load offline, are really trained, the draft tracks the
target and the reasoner thinks before it answers.

Bounds are set from the measurements in deploy/models/MODEL_CARD.md with a margin for the
sampled evaluation windows; a pair that was not trained, or a broken draft, fails them.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loadgen.prompts import demo_training_script

TARGET_HELDOUT_LOSS_MAX = 3.4
DRAFT_AGREEMENT_MIN = 0.65
MAX_PAIR_BYTES = 30 * 1024 * 1024
REASONER_THINKS_MIN = 0.75
"""Of 8 held-out signatures, the share whose greedy output thinks, and answers after its
`</think>` (MODEL_CARD.md has the 48-signature figures)."""


@pytest.fixture(scope="module")
def train_demo() -> ModuleType:
    return demo_training_script()


@pytest.fixture(scope="module")
def pair(target_dir: Path, draft_dir: Path):  # type: ignore[no-untyped-def]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target, draft


@pytest.fixture(scope="module")
def heldout_texts(train_demo: ModuleType) -> list[str]:
    _, texts = train_demo.read_split()
    return texts


@pytest.fixture(scope="module")
def heldout(train_demo: ModuleType, target_dir: Path, heldout_texts: list[str]) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return train_demo.encode_stream(tokenizer, heldout_texts)


def test_pair_is_small_and_complete(target_dir: Path, draft_dir: Path, reasoner_dir: Path) -> None:
    total = 0
    for d in (target_dir, draft_dir):
        for name in (
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "generation_config.json",
        ):
            assert (d / name).is_file(), f"{d / name} missing"
        total += sum(f.stat().st_size for f in d.iterdir())
    assert total < MAX_PAIR_BYTES
    assert sum(f.stat().st_size for f in reasoner_dir.iterdir()) < MAX_PAIR_BYTES / 2


def test_tokenizers_match_and_round_trip(
    target_dir: Path, draft_dir: Path, reasoner_dir: Path
) -> None:
    """The pair's tokenizers agree, and the reasoner's encodes every text but its markers
    as theirs does."""
    t = AutoTokenizer.from_pretrained(target_dir)
    d = AutoTokenizer.from_pretrained(draft_dir)
    r = AutoTokenizer.from_pretrained(reasoner_dir)
    text = "def add(a, b):\n    return a + b\n"
    assert t(text)["input_ids"] == d(text)["input_ids"] == r(text)["input_ids"]
    assert t.decode(t(text)["input_ids"]) == text
    assert t.eos_token == "<|endoftext|>"
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "hi" in chat


def test_target_heldout_loss(pair, heldout: torch.Tensor, train_demo: ModuleType) -> None:  # type: ignore[no-untyped-def]
    target, draft = pair
    loss = train_demo.heldout_loss(target, heldout, 256, 12)
    draft_loss = train_demo.heldout_loss(draft, heldout, 256, 12)
    assert loss < TARGET_HELDOUT_LOSS_MAX, loss
    assert loss < draft_loss, "the target should model held-out code better than its draft"


def test_draft_agrees_with_target(pair, heldout: torch.Tensor, train_demo: ModuleType) -> None:  # type: ignore[no-untyped-def]
    target, draft = pair
    agreement = train_demo.greedy_agreement(target, draft, heldout, 8, 32)
    assert agreement > DRAFT_AGREEMENT_MIN, agreement


def test_target_writes_python(pair, target_dir: Path) -> None:  # type: ignore[no-untyped-def]
    target, _ = pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = tokenizer("def", return_tensors="pt")["input_ids"]
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
    text = str(tokenizer.decode(out[0]))
    first_line = text.splitlines()[0]
    assert first_line.startswith("def ") and first_line[4:5].isidentifier() and "(" in first_line, (
        text
    )
    kinds = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            kinds.append(tok.type)
    except tokenize.TokenError:
        pass  # the cut may leave a bracket open: a prefix of valid code is what we check
    assert tokenize.ERRORTOKEN not in kinds, text
    assert kinds.count(tokenize.NAME) >= 3, text


def test_the_reasoner_s_markers_are_tokens_of_its_own_kept_in_the_text(
    target_dir: Path, reasoner_dir: Path
) -> None:
    """A thinking stage ends on `</think>`: one token, decoded as text for the reasoning
    parser."""
    reasoner = AutoTokenizer.from_pretrained(reasoner_dir)
    pair = AutoTokenizer.from_pretrained(target_dir)
    for marker in ("<think>", "</think>"):
        (token,) = reasoner(marker, add_special_tokens=False)["input_ids"]
        assert token >= len(pair)
        assert reasoner.decode([token], skip_special_tokens=True) == marker


def test_the_reasoner_thinks_then_answers(
    reasoner_dir: Path, train_demo: ModuleType, heldout_texts: list[str]
) -> None:
    model = AutoModelForCausalLM.from_pretrained(reasoner_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(reasoner_dir)
    report = train_demo.thinks_then_answers(model, tokenizer, heldout_texts, 8)
    assert report["starts_thinking"] >= REASONER_THINKS_MIN, report
    assert report["answers_after"] >= REASONER_THINKS_MIN, report
