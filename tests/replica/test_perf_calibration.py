from __future__ import annotations

import pytest

from replica.perf_calibration import CalibratedPerfModel, Calibration, ShapeClass, shape_class
from replica.perf_info import ProfileInfo
from replica.perf_model import (
    FEATURES,
    BatchShape,
    BatchTimeModel,
    PerfModel,
    Term,
)

DECODE = BatchShape((1,) * 8, (200,) * 8).features()
PREFILL = BatchShape((512,), (0,)).features()
MIXED = BatchShape((1,) * 8 + (32,), (200,) * 9).features()
SPECULATIVE = BatchShape((4,) * 8, (200,) * 8, draft_steps=3, draft_batch=8).features()


def model() -> PerfModel:
    coefficients = dict.fromkeys(FEATURES, 0.0) | {"const": 0.01, "tokens": 1e-4}
    term = Term("linear", tuple(coefficients[f] for f in FEATURES))
    return PerfModel((term,), ProfileInfo(source="analytic", backend="t", device="d", model="m"))


def test_shape_classes() -> None:
    assert shape_class(DECODE) is ShapeClass.DECODE
    assert shape_class(PREFILL) is ShapeClass.PREFILL
    assert shape_class(MIXED) is ShapeClass.MIXED
    assert shape_class(SPECULATIVE) is ShapeClass.SPECULATIVE


def test_calibration_converges_to_the_true_ratio_per_class() -> None:
    calibration = Calibration(alpha=0.2)
    for step in range(60):
        drift = 1.0 + (0.1 if step % 2 else -0.1)
        calibration.observe(DECODE, predicted_s=0.010, measured_s=0.013 * drift)
        calibration.observe(PREFILL, predicted_s=0.100, measured_s=0.080)
    assert calibration.factor(ShapeClass.DECODE) == pytest.approx(1.3, rel=0.03)
    assert calibration.factor(ShapeClass.PREFILL) == pytest.approx(0.8)
    assert calibration.factor(ShapeClass.MIXED) == 1.0
    assert calibration.observations[ShapeClass.DECODE] == 60


def test_calibration_is_deterministic_and_validates() -> None:
    a, b = Calibration(alpha=0.3), Calibration(alpha=0.3)
    for measured in (0.011, 0.009, 0.015):
        a.observe(MIXED, 0.01, measured)
        b.observe(MIXED, 0.01, measured)
    assert a == b
    with pytest.raises(ValueError, match="measured_s must be finite and > 0"):
        a.observe(MIXED, 0.01, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        Calibration(alpha=0.0)


def test_calibrated_model_scales_predictions_and_its_inverse() -> None:
    calibrated = CalibratedPerfModel(model())
    planner_view: BatchTimeModel = calibrated
    assert planner_view.predict(BatchShape((1,), (0,))) == model().predict(BatchShape((1,), (0,)))
    raw = model().predict_features(PREFILL)
    for _ in range(30):
        calibrated.observe(PREFILL, measured_s=1.5 * raw)
    assert calibrated.predict_features(PREFILL) == pytest.approx(1.5 * raw)
    assert calibrated.predict(BatchShape((1,) * 8, (200,) * 8)) == model().predict_features(DECODE)
    limit = 0.05
    extra = calibrated.max_new_tokens_within(
        limit, num_requests=1, base_tokens=0, base_attn_tokens=0, context_per_new_token=10
    )
    assert extra > 0
    grown = calibrated.predict_aggregate(
        num_tokens=extra, num_requests=1, attn_tokens=10 * extra, kv_tokens=extra
    )
    assert grown <= limit
    assert extra < model().max_new_tokens_within(
        limit, num_requests=1, base_tokens=0, base_attn_tokens=0, context_per_new_token=10
    )
