"""Online correction of a perf model from measured step times, without refitting.

A fitted or analytic profile drifts (thermal throttling, other tenants, a different kernel
mix). The controller feeds each executed step's predicted and measured seconds back; per shape
class we keep an exponential moving average of measured / predicted and scale predictions by
it. Classes keep one class's drift (e.g. slow prefills) from distorting another's (decodes).
Deterministic and pure: no clock, no randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from replica.perf_model import BatchFeatures, BatchShape, PerfModel

PREFILL_HEAVY_TOKENS_PER_REQUEST = 16
"""Batches averaging at least this many query tokens per request count as prefill-heavy."""


class ShapeClass(StrEnum):
    DECODE = "decode"
    """One query token per request, no drafting."""
    MIXED = "mixed"
    """Some prefill alongside decodes (fewer than PREFILL_HEAVY_TOKENS_PER_REQUEST per request)."""
    PREFILL = "prefill"
    """Prefill-heavy: at least PREFILL_HEAVY_TOKENS_PER_REQUEST query tokens per request."""
    SPECULATIVE = "speculative"
    """The draft model runs this step."""


def shape_class(features: BatchFeatures) -> ShapeClass:
    if features.draft_steps > 0:
        return ShapeClass.SPECULATIVE
    if features.num_tokens <= features.num_requests:
        return ShapeClass.DECODE
    if features.num_tokens >= PREFILL_HEAVY_TOKENS_PER_REQUEST * features.num_requests:
        return ShapeClass.PREFILL
    return ShapeClass.MIXED


@dataclass
class Calibration:
    """EMA of measured / predicted step time per shape class (1.0 until observed)."""

    alpha: float = 0.1
    """Weight of the newest observation."""
    factors: dict[ShapeClass, float] = field(default_factory=dict)
    observations: dict[ShapeClass, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def factor(self, cls: ShapeClass) -> float:
        return self.factors.get(cls, 1.0)

    def observe(self, features: BatchFeatures, predicted_s: float, measured_s: float) -> float:
        """Fold one executed step in; returns its class's new factor."""
        for name, value in (("predicted_s", predicted_s), ("measured_s", measured_s)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        cls = shape_class(features)
        ratio = measured_s / predicted_s
        count = self.observations.get(cls, 0)
        previous = self.factors.get(cls, ratio)
        updated = ratio if count == 0 else (1 - self.alpha) * previous + self.alpha * ratio
        self.factors[cls] = updated
        self.observations[cls] = count + 1
        return updated


@dataclass
class CalibratedPerfModel:
    """A PerfModel whose predictions are scaled by a Calibration; same query methods."""

    model: PerfModel
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def tp(self) -> int:
        return self.model.tp

    def predict_features(self, features: BatchFeatures) -> float:
        factor = self.calibration.factor(shape_class(features))
        return factor * self.model.predict_features(features)

    def predict(self, shape: BatchShape) -> float:
        factor = self.calibration.factor(shape_class(shape.features()))
        return factor * self.model.predict(shape)

    def predict_aggregate(
        self,
        *,
        num_tokens: int,
        num_requests: int,
        attn_tokens: int,
        draft_steps: int = 0,
        draft_batch: int = 0,
        kv_tokens: int | None = None,
        padded_attn_tokens: int | None = None,
    ) -> float:
        features = BatchFeatures(
            num_tokens=num_tokens,
            num_requests=num_requests,
            attn_tokens=attn_tokens,
            kv_tokens=attn_tokens if kv_tokens is None else kv_tokens,
            draft_steps=draft_steps,
            draft_batch=draft_batch,
            padded_attn_tokens=padded_attn_tokens,
        )
        return self.predict_features(features)

    def observe(self, features: BatchFeatures, measured_s: float) -> float:
        """Feed a measured step back; the prediction compared is the uncalibrated model's."""
        return self.calibration.observe(features, self.model.predict_features(features), measured_s)

    def max_new_tokens_within(
        self,
        time_limit_s: float,
        *,
        num_requests: int,
        base_tokens: int,
        base_attn_tokens: int,
        context_per_new_token: int = 0,
        draft_steps: int = 0,
        draft_batch: int = 0,
        base_kv_tokens: int | None = None,
    ) -> int:
        """As PerfModel's, with the limit divided by the largest factor among the classes the
        grown batch can fall in (so the calibrated prediction stays within the limit)."""
        if draft_steps > 0:
            classes = [ShapeClass.SPECULATIVE]
        else:
            classes = [ShapeClass.MIXED, ShapeClass.PREFILL]
        factor = max(self.calibration.factor(c) for c in classes)
        return self.model.max_new_tokens_within(
            time_limit_s / factor,
            num_requests=num_requests,
            base_tokens=base_tokens,
            base_attn_tokens=base_attn_tokens,
            context_per_new_token=context_per_new_token,
            draft_steps=draft_steps,
            draft_batch=draft_batch,
            base_kv_tokens=base_kv_tokens,
        )
