from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.perf_info import ProfileInfo, Slowdown
from replica.perf_model import (
    FEATURES,
    BatchFeatures,
    BatchShape,
    PerfModel,
    Term,
    attention_pairs,
)


def coefficients(**values: float) -> tuple[float, ...]:
    return tuple(values.get(name, 0.0) for name in FEATURES)


def two_term_model() -> PerfModel:
    """Memory-bound floor of 10 ms vs compute growing with tokens and attention."""
    memory = Term(
        "memory",
        coefficients(const=0.010, kv_tokens=1e-7, draft_steps=1e-3, draft_kv_tokens=5e-8),
    )
    compute = Term(
        "compute",
        coefficients(const=0.002, tokens=5e-5, requests=1e-6, attn_tokens=2e-9, draft_steps=1e-3),
    )
    info = ProfileInfo(source="analytic", backend="test", device="cpu", model="toy")
    return PerfModel((memory, compute), info)


def test_attention_pairs_counts_causal_chunk_on_context() -> None:
    assert attention_pairs(1, 10) == 11
    assert attention_pairs(4, 0) == 10
    assert attention_pairs(3, 5) == 3 * 5 + 6


def test_batch_shape_features() -> None:
    shape = BatchShape(new_tokens=(8, 1, 3), context=(0, 100, 50), draft_steps=2, draft_batch=1)
    f = shape.features()
    assert f.num_tokens == 12
    assert f.num_requests == 3
    assert f.attn_tokens == 36 + 101 + (150 + 6)
    assert f.kv_tokens == 12 + 150
    assert f.padded_attn_tokens == 3 * 8 * 101
    assert f.vector() == (1.0, 12.0, 3.0, 293.0, 162.0, 2424.0, 2.0, 2.0, 2 * 162 / 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"new_tokens": (1, 2), "context": (0,)}, "context has 1"),
        ({"new_tokens": (0,), "context": (0,)}, "new_tokens entries must be >= 1"),
        ({"new_tokens": (1,), "context": (-1,)}, "context entry must be >= 0"),
        ({"new_tokens": (1,), "context": (0,), "draft_steps": 2}, "both be 0"),
        ({"new_tokens": (1,), "context": (0,), "draft_steps": 1, "draft_batch": 2}, "exceeds"),
        ({"new_tokens": (1,), "context": (0,), "tp": 0}, "tp must be >= 1"),
    ],
)
def test_batch_shape_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchShape(**kwargs)  # type: ignore[arg-type]


def test_predict_is_the_max_of_terms() -> None:
    model = two_term_model()
    decode = BatchShape((1,) * 4, (100,) * 4)
    assert model.predict(decode) == pytest.approx(0.010 + 1e-7 * 404)
    prefill = BatchShape((1000,), (0,))
    expected = 0.002 + 5e-5 * 1000 + 1e-6 + 2e-9 * attention_pairs(1000, 0)
    assert model.predict(prefill) == pytest.approx(expected)


def test_predict_aggregate_matches_shape_and_defaults_kv_to_attention() -> None:
    model = two_term_model()
    shape = BatchShape((1, 1, 300), (500, 20, 40), draft_steps=3, draft_batch=2)
    f = shape.features()
    exact = model.predict_aggregate(
        num_tokens=f.num_tokens,
        num_requests=f.num_requests,
        attn_tokens=f.attn_tokens,
        draft_steps=3,
        draft_batch=2,
        kv_tokens=f.kv_tokens,
    )
    assert exact == model.predict(shape)
    bound = model.predict_aggregate(
        num_tokens=f.num_tokens,
        num_requests=f.num_requests,
        attn_tokens=f.attn_tokens,
        draft_steps=3,
        draft_batch=2,
    )
    assert bound >= exact


def test_predict_rejects_other_tp_and_bad_aggregates() -> None:
    model = two_term_model()
    with pytest.raises(ValueError, match="tp=2"):
        model.predict(BatchShape((1,), (0,), tp=2))
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        model.predict_aggregate(num_tokens=-1, num_requests=0, attn_tokens=0)
    with pytest.raises(ValueError, match="draft_batch=3 exceeds num_requests=2"):
        model.predict_aggregate(
            num_tokens=2, num_requests=2, attn_tokens=2, draft_steps=1, draft_batch=3
        )


def test_model_rejects_negative_or_token_free_terms() -> None:
    info = ProfileInfo(source="analytic", backend="t", device="d", model="m")
    with pytest.raises(ValueError, match="coefficient tokens must be finite and >= 0"):
        Term("bad", coefficients(tokens=-1.0))
    with pytest.raises(ValueError, match="charge for tokens or kv_tokens"):
        PerfModel((Term("flat", coefficients(const=1.0)),), info)
    with pytest.raises(ValueError, match="needs r2 and mape"):
        ProfileInfo(source="measured", backend="t", device="d", model="m")
    with pytest.raises(ValueError, match="source must be one of"):
        ProfileInfo(source="guessed", backend="t", device="d", model="m")


def test_json_round_trip(tmp_path: Path) -> None:
    model = two_term_model()
    measured = replace(
        model.info,
        source="measured",
        r2=0.97,
        mape=0.04,
        tp=1,
        notes=("n",),
        fit={"num_train": 10},
        assumptions={"x": 1.5},
    )
    model = PerfModel(model.terms, measured)
    path = tmp_path / "profile.json"
    model.save(path)
    loaded = PerfModel.load(path)
    assert loaded == model
    data = model.to_dict()
    assert data["source"] == "measured"
    assert data["r2"] == 0.97
    assert data["mape"] == 0.04


def test_a_file_that_is_not_a_json_object_is_not_a_profile(tmp_path: Path) -> None:
    for name, text, kind in [("list.json", "[1, 2]", "holds a list"), ("e.json", "", "not JSON")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"not a perf profile: .*{kind}"):
            PerfModel.load(tmp_path / name)


def test_from_dict_rejects_foreign_or_incomplete_files() -> None:
    data = two_term_model().to_dict()
    with pytest.raises(ValueError, match="not a perf profile"):
        PerfModel.from_dict({**data, "format": "other"})
    with pytest.raises(ValueError, match="features"):
        PerfModel.from_dict({**data, "features": ["const"]})
    broken = {**data, "terms": [{"name": "t", "coefficients": {"const": 1.0}}]}
    with pytest.raises(ValueError, match="lacks coefficients"):
        PerfModel.from_dict(broken)
    slow = {**data["terms"][0], "coefficients": {**data["terms"][0]["coefficients"], "tokens": "x"}}
    with pytest.raises(ValueError, match="term 'memory': coefficients must be numbers"):
        PerfModel.from_dict({**data, "terms": [slow]})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"terms": None}, "not a perf profile: it has no terms"),
        ({"source": None, "model": None}, "not a perf profile: it has no source, model"),
        ({"terms": {"name": "t"}}, "profile terms must be a list, got {'name': 't'}"),
        ({"terms": [5]}, r"a profile term must be \{name, coefficients\}, got 5"),
        ({"terms": [{"coefficients": {}}]}, r"a profile term must be \{name, coefficients\}"),
        ({"terms": [{"name": "t", "coefficients": [1]}]}, "a profile term must be"),
    ],
)
def test_a_profile_missing_a_field_is_named(change: dict[str, object], message: str) -> None:
    data = {**two_term_model().to_dict(), **change}
    data = {key: value for key, value in data.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        PerfModel.from_dict(data)


def test_max_new_tokens_within_zero_when_base_already_too_slow() -> None:
    model = two_term_model()
    assert (
        model.max_new_tokens_within(0.005, num_requests=4, base_tokens=4, base_attn_tokens=400) == 0
    )


@settings(max_examples=200, deadline=None)
@given(
    limit_ms=st.floats(min_value=1.0, max_value=500.0),
    decodes=st.integers(min_value=0, max_value=64),
    context=st.integers(min_value=0, max_value=4000),
    per_token=st.integers(min_value=0, max_value=4000),
    draft_steps=st.integers(min_value=0, max_value=5),
)
def test_inverse_is_consistent_with_predict(
    limit_ms: float, decodes: int, context: int, per_token: int, draft_steps: int
) -> None:
    model = two_term_model()
    limit = limit_ms / 1e3
    draft_batch = decodes if draft_steps and decodes else 0
    draft_steps = draft_steps if draft_batch else 0
    base = {
        "num_requests": decodes + 1,
        "base_tokens": decodes,
        "base_attn_tokens": decodes * (context + 1),
        "draft_steps": draft_steps,
        "draft_batch": draft_batch,
    }
    extra = model.max_new_tokens_within(limit, context_per_new_token=per_token, **base)

    def seconds(x: int) -> float:
        return model.predict_aggregate(
            num_tokens=decodes + x,
            num_requests=decodes + 1,
            attn_tokens=decodes * (context + 1) + x * per_token,
            kv_tokens=decodes * (context + 1) + x,
            draft_steps=draft_steps,
            draft_batch=draft_batch,
        )

    assert extra >= 0
    if extra > 0:
        assert seconds(extra) <= limit
    assert seconds(extra + 1) > limit or seconds(0) > limit


def test_features_reject_negative_counts() -> None:
    with pytest.raises(ValueError, match="kv_tokens must be >= 0"):
        BatchFeatures(num_tokens=1, num_requests=1, attn_tokens=1, kv_tokens=-1)


def test_synthetic_model_from_round_numbers() -> None:
    model = PerfModel.synthetic({"tokens": 1 / 6}, {"const": 0.5})
    assert model.predict(BatchShape(new_tokens=(6,), context=(0,))) == pytest.approx(1.0)
    assert model.predict(BatchShape(new_tokens=(1,), context=(0,))) == pytest.approx(0.5)
    assert model.info.device == "synthetic"
    with pytest.raises(ValueError, match="unknown features"):
        PerfModel.synthetic({"flops": 1.0})


def test_slowed_model_is_factor_times_the_profile_plus_the_overhead() -> None:
    model = two_term_model()
    slow = model.slowed(Slowdown(3.0, 0.005))
    shapes = [
        BatchShape((1,) * 4, (100,) * 4),
        BatchShape((1000,), (0,)),
        BatchShape((1, 1), (50, 80), draft_steps=3, draft_batch=2),
    ]
    for shape in shapes:
        assert slow.predict(shape) == pytest.approx(3.0 * model.predict(shape) + 0.005)
    # The inverse follows: what fits 60 ms on the slow model fits 55 / 3 ms on the profile.
    within = {"num_requests": 1, "base_tokens": 0, "base_attn_tokens": 0}
    assert slow.max_new_tokens_within(0.060, **within) == model.max_new_tokens_within(
        0.055 / 3.0, **within
    )
    assert slow.info.notes[-1] == "slowed: 3 x the profile + 5 ms per step"
    assert model.slowed(Slowdown()).predict(shapes[1]) == model.predict(shapes[1])
    assert Slowdown().is_none and not Slowdown(1.0, 0.001).is_none


@pytest.mark.parametrize(
    ("factor", "overhead", "message"),
    [
        (0.0, 0.0, "slowdown factor must be > 0"),
        (float("inf"), 0.0, "slowdown factor must be finite"),
        (True, 0.0, "slowdown factor must be a number"),
        (2.0, -0.001, "slowdown overhead_s must be >= 0"),
        (2.0, float("nan"), "slowdown overhead_s must be finite"),
    ],
)
def test_slowdown_refuses_bad_values(factor: float, overhead: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Slowdown(factor, overhead)


def test_least_work_is_the_requests_own_features_without_fixed_costs() -> None:
    perf = PerfModel.synthetic(
        {"const": 0.5, "tokens": 0.001, "requests": 0.01, "attn_tokens": 1e-5, "kv_tokens": 1e-4}
    )
    # Prompt 4 in one chunk: 4 tokens, 1 request, 10 causal pairs, 4 KV. Then 2 decode steps
    # on 4 and 5 cached tokens: 2 tokens, 2 requests, 5 + 6 pairs, 5 + 6 KV. No const.
    expected = 0.001 * 6 + 0.01 * 3 + 1e-5 * 21 + 1e-4 * 15
    assert perf.least_work_seconds([(4, 3)]) == pytest.approx(expected)
    assert perf.least_work_seconds([(4, 1)]) == pytest.approx(0.001 * 4 + 0.01 + 1e-5 * 10 + 4e-4)
    # Slower hardware costs more; a per-step overhead is a fixed cost, shared, so it does not.
    assert perf.slowed(Slowdown(2.0, 0.3)).least_work_seconds([(4, 3)]) == pytest.approx(
        2 * expected
    )
    with pytest.raises(ValueError, match="output_len=0"):
        perf.least_work_seconds([(4, 0)])


def test_least_work_sums_the_requests_features_before_the_max_over_terms() -> None:
    """One term prices prefill tokens, the other decode requests: a batch holding both costs
    the max of the sums, less than the sum of each request's own max."""
    perf = PerfModel.synthetic({"tokens": 0.01}, {"requests": 0.05})
    prefill, decodes = (100, 1), (1, 21)  # 100 tokens, 1 request; 21 tokens, 21 requests
    alone = perf.least_work_seconds([prefill]) + perf.least_work_seconds([decodes])
    assert alone == pytest.approx(1.0 + 1.05)
    assert perf.least_work_seconds([prefill, decodes]) == pytest.approx(max(1.21, 1.1))


CPU_NODRAFT = PerfModel.load(
    Path(__file__).resolve().parents[2] / "deploy" / "profiles" / "cpu-demo-nodraft.json"
)
SPLIT_TERMS = PerfModel.synthetic({"tokens": 0.01}, {"requests": 0.05})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e-3) | st.just(0.0), min_size=len(FEATURES), max_size=len(FEATURES)),
    st.lists(st.integers(0, 10**6), min_size=len(FEATURES), max_size=len(FEATURES)),
)
def test_a_term_prices_every_feature_it_charges(coefs: list[float], counts: list[int]) -> None:
    x = tuple(float(c) for c in counts)
    assert Term("t", tuple(coefs)).seconds(x) == sum(c * v for c, v in zip(coefs, x, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3000), st.integers(1, 3000))
def test_least_work_equals_its_schedule_batch_by_batch(prompt: int, output: int) -> None:
    """The closed form against the schedule it stands for, built entry by entry."""
    perf = two_term_model()
    prefill = BatchShape((prompt,), (0,)).features()
    steps = output - 1
    decode = BatchShape((1,) * steps, tuple(range(prompt, prompt + steps))).features()
    own = BatchFeatures(
        num_tokens=prefill.num_tokens + decode.num_tokens,
        num_requests=prefill.num_requests + decode.num_requests,
        attn_tokens=prefill.attn_tokens + decode.attn_tokens,
        kv_tokens=prefill.kv_tokens + decode.kv_tokens,
        padded_attn_tokens=0,
    )
    # No fixed cost: steps share it.
    unfixed = replace(
        perf,
        terms=tuple(replace(t, coefficients=(0.0, *t.coefficients[1:])) for t in perf.terms),
    )
    assert perf.least_work_seconds([(prompt, output)]) == pytest.approx(
        unfixed.predict_features(own), rel=1e-12
    )


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=5),
    data=st.data(),
)
def test_no_schedule_of_a_workload_costs_less_than_its_requests_least_times(
    lengths: list[tuple[int, int]], data: st.DataObject
) -> None:
    """Any schedule: prompts in random chunks, requests joining steps at random; on the
    shipped CPU profile and on two terms that price different batches."""
    perf = data.draw(st.sampled_from([CPU_NODRAFT, SPLIT_TERMS]))
    least = perf.least_work_seconds(lengths)
    computed = [0] * len(lengths)
    produced = [0] * len(lengths)
    spent = 0.0
    while any(n < o for n, (_, o) in zip(produced, lengths, strict=True)):
        open_ = [i for i, (n, (_, o)) in enumerate(zip(produced, lengths, strict=True)) if n < o]
        chosen = data.draw(st.lists(st.sampled_from(open_), min_size=1, unique=True))
        new, context = [], []
        for i in chosen:
            prompt = lengths[i][0]
            if computed[i] < prompt:
                chunk = data.draw(st.integers(1, prompt - computed[i]))
                produced[i] += computed[i] + chunk == prompt
            else:
                chunk = 1
                produced[i] += 1
            new.append(chunk)
            context.append(computed[i])
            computed[i] += chunk
        spent += perf.predict(BatchShape(tuple(new), tuple(context)))
    assert spent >= least - 1e-12
