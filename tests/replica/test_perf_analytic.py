from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.perf_analytic import (
    A100_40GB,
    A100_80GB,
    H100_80GB,
    LLAMA_31_8B,
    LLAMA_31_70B,
    LLAMA_32_1B,
    OPT_7B,
    OPT_125M,
    analytic_profile,
    analytic_profiles,
    fits,
    reference_points,
)
from replica.perf_model import BatchShape, PerfModel

PROFILES = Path(__file__).resolve().parents[2] / "deploy" / "profiles"
ANALYTIC = analytic_profiles()


def test_shipped_profiles_match_the_generator() -> None:
    shipped = {
        path.stem: json.loads(path.read_text())
        for path in PROFILES.glob("*.json")
        if json.loads(path.read_text())["source"] == "analytic"
    }
    assert set(shipped) == set(ANALYTIC)
    for name, model in ANALYTIC.items():
        assert shipped[name] == json.loads(json.dumps(model.to_dict())), name


def test_catalogue_holds_only_combinations_that_fit() -> None:
    assert "a100-40gb-llama-31-70b-tp4" not in ANALYTIC
    assert "a100-80gb-llama-31-70b-tp4" in ANALYTIC
    assert "h100-80gb-llama-31-70b-tp4" in ANALYTIC
    assert len(ANALYTIC) == 14
    assert not fits(A100_40GB, LLAMA_31_70B, LLAMA_32_1B, 4)
    with pytest.raises(ValueError, match="does not fit on A100-40GB"):
        analytic_profile(A100_40GB, LLAMA_31_70B, LLAMA_32_1B, 4)


def test_every_profile_says_it_is_analytic_and_lists_assumptions() -> None:
    for model in ANALYTIC.values():
        data = model.to_dict()
        assert data["source"] == "analytic"
        assert data["assumptions"]["gemm_efficiency"] > 0
        assert any("Predicted" in note for note in data["notes"])
        assert PerfModel.from_dict(data) == model


def test_seven_b_decode_matches_published_ballpark() -> None:
    """vLLM-class systems decode a 7B model at batch 1 in roughly 12-20 ms on an A100."""
    for device in (A100_40GB, A100_80GB):
        step = reference_points(analytic_profile(device, OPT_7B, OPT_125M, 1))
        assert 0.012 <= step["decode_b1_ctx512_s"] <= 0.020
    h100 = reference_points(analytic_profile(H100_80GB, LLAMA_31_8B, LLAMA_32_1B, 1))
    a100 = reference_points(analytic_profile(A100_80GB, LLAMA_31_8B, LLAMA_32_1B, 1))
    assert h100["decode_b1_ctx512_s"] < a100["decode_b1_ctx512_s"]
    assert h100["prefill_2048_s"] < a100["prefill_2048_s"]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(ANALYTIC)),
    new=st.lists(st.integers(1, 2048), min_size=1, max_size=8),
    context=st.integers(0, 8000),
    more_tokens=st.integers(1, 512),
    more_context=st.integers(1, 4000),
)
def test_profiles_are_monotone_in_tokens_and_context(
    name: str, new: list[int], context: int, more_tokens: int, more_context: int
) -> None:
    model = ANALYTIC[name]
    tp = model.tp
    contexts = (context,) * len(new)
    base = model.predict(BatchShape(tuple(new), contexts, tp=tp))
    grown = (new[0] + more_tokens, *new[1:])
    assert model.predict(BatchShape(grown, contexts, tp=tp)) >= base
    longer = (context + more_context,) * len(new)
    assert model.predict(BatchShape(tuple(new), longer, tp=tp)) >= base
    drafted = BatchShape(tuple(new), contexts, draft_steps=2, draft_batch=len(new), tp=tp)
    assert model.predict(drafted) > base
