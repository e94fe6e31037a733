"""Fitting a max-of-linear batch-time model to measured steps, and scoring it.

Method (max-affine regression, as in Magnani & Boyd 2009, with non-negative terms):
1. Start from a partition of the training samples into K groups: contiguous quantile ranges of
   one feature at a time (tokens, attention, KV, drafting), K = 1..max_terms.
2. Fit each group's term by non-negative least squares (NNLS, Lawson-Hanson active set, below).
3. Reassign every sample to the term that is largest on it (the active bottleneck); repeat 2-3
   until the assignment stops changing.
4. Keep the lowest-loss model over all starts that charges for tokens somewhere, then drop
   terms the fit does not need (a term that is never the maximum, or a duplicate).

Why this method: it fits the max form itself (each sample teaches the bottleneck that binds
it), each round is a few small NNLS solves (milliseconds for hundreds of samples), and the
deterministic quantile starts avoid the local minima a single start falls into. Regressing a
single linear model instead cannot represent "flat until compute-bound" batches.

Residuals are relative ((pred - y) / y): step times span orders of magnitude, and the planner
cares about percentage error on short decode steps as much as on long prefills. NNLS (not plain
least squares) keeps every coefficient >= 0, so the model stays monotone and invertible; it is
written here because the project does not depend on scipy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from replica.perf_info import ProfileInfo
from replica.perf_model import FEATURES, BatchFeatures, PerfModel, Term

MAX_ASSIGN_ROUNDS = 50
_SPLIT_FEATURES = ("tokens", "attn_tokens", "kv_tokens", "draft_tokens", "requests")
_COUNT_FIELDS = (
    "num_tokens",
    "num_requests",
    "attn_tokens",
    "kv_tokens",
    "padded_attn_tokens",
    "draft_steps",
    "draft_batch",
)
_GROWS_WITH_TOKENS = [FEATURES.index("tokens"), FEATURES.index("kv_tokens")]


@dataclass(frozen=True)
class Sample:
    """One measured step: its features and its time in seconds (median of repeats)."""

    features: BatchFeatures
    seconds: float

    def __post_init__(self) -> None:
        if not np.isfinite(self.seconds) or self.seconds <= 0:
            raise ValueError(f"sample seconds must be finite and > 0, got {self.seconds!r}")


def samples_to_json(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Samples as plain JSON (kept in a measured profile so it can be refitted or plotted)."""
    return [{"features": _counts(s.features), "seconds": s.seconds} for s in samples]


def _counts(features: BatchFeatures) -> dict[str, int]:
    counts = {name: getattr(features, name) for name in _COUNT_FIELDS}
    if features.padded_attn_tokens is None:
        counts["padded_attn_tokens"] = features.attn_tokens
    return counts


def samples_from_json(rows: Sequence[dict[str, Any]]) -> list[Sample]:
    return [
        Sample(
            BatchFeatures(**{name: int(row["features"][name]) for name in _COUNT_FIELDS}),
            float(row["seconds"]),
        )
        for row in rows
    ]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set).

    Columns are scaled to unit norm first so the tolerance means the same for every feature."""
    m, n = a.shape
    if b.shape != (m,):
        raise ValueError(f"b has shape {b.shape}, expected ({m},)")
    norms = np.linalg.norm(a, axis=0)
    scale = np.where(norms > 0, norms, 1.0)
    a = a / scale
    tol = 1e-10 * max(1.0, float(np.linalg.norm(b)))
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter or 3 * n + 10):
        gradient = a.T @ (b - a @ x)
        candidates = np.where(passive | (norms == 0), -np.inf, gradient)
        j = int(np.argmax(candidates))
        if candidates[j] <= tol:
            break
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            blocking = passive & (z <= 0)
            gap = x[blocking] - z[blocking]
            ratios = np.divide(x[blocking], gap, out=np.zeros_like(gap), where=gap > 0)
            step = float(np.min(ratios))
            x = x + step * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale


def _design(samples: Sequence[Sample]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([s.features.vector() for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    return x, y


def _predict(coefficients: np.ndarray, x: np.ndarray) -> np.ndarray:
    result: np.ndarray = (x @ coefficients.T).max(axis=1)
    return result


def _loss(coefficients: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum(((_predict(coefficients, x) - y) / y) ** 2))


def _refine(x: np.ndarray, y: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, float]:
    """Alternate NNLS per group and argmax reassignment; return the best coefficients seen."""
    best_coefficients = np.zeros((1, x.shape[1]))
    best_loss = np.inf
    for _ in range(MAX_ASSIGN_ROUNDS):
        rows = []
        for group in np.unique(labels):
            members = labels == group
            weighted = x[members] / y[members, None]
            rows.append(nnls(weighted, np.ones(int(members.sum()))))
        coefficients = np.array(rows)
        loss = _loss(coefficients, x, y)
        if loss < best_loss:
            best_coefficients, best_loss = coefficients, loss
        new_labels = np.argmax(x @ coefficients.T, axis=1)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return best_coefficients, best_loss


def _starts(x: np.ndarray, num_terms: int) -> list[np.ndarray]:
    """Deterministic initial partitions: quantile ranges of each informative feature."""
    starts = []
    for name in _SPLIT_FEATURES:
        column = x[:, FEATURES.index(name)]
        if np.ptp(column) == 0:
            continue
        order = np.argsort(column, kind="stable")
        labels = np.empty(len(column), dtype=int)
        for group, chunk in enumerate(np.array_split(order, num_terms)):
            labels[chunk] = group
        starts.append(labels)
    return starts


def fit_terms(samples: Sequence[Sample], max_terms: int = 3) -> tuple[Term, ...]:
    """Fit up to `max_terms` non-negative linear terms whose max matches the samples.

    Among all starts, the lowest-loss fit that charges for tokens (or KV tokens) in some term
    wins: a model where prefill tokens cost nothing cannot bound the planner's inverse."""
    if max_terms < 1:
        raise ValueError(f"max_terms must be >= 1, got {max_terms}")
    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} samples to fit, got {len(samples)}")
    x, y = _design(samples)
    candidates = [_refine(x, y, np.zeros(len(y), dtype=int))]
    for k in range(2, max_terms + 1):
        candidates += [_refine(x, y, labels) for labels in _starts(x, k)]
    charging = [c for c in candidates if np.any(c[0][:, _GROWS_WITH_TOKENS] > 0)]
    if not charging:
        raise ValueError(
            "no fit charges for tokens: the samples' times do not grow with batch tokens "
            "(too noisy, or a grid without token variation)"
        )
    best = min(charging, key=lambda c: c[1])[0]
    kept = _prune(best, x, y)
    return tuple(Term(f"term{i}", tuple(float(v) for v in row)) for i, row in enumerate(kept))


def _prune(coefficients: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Drop terms the fit does not need (duplicates, never the maximum)."""
    loss = _loss(coefficients, x, y)
    k = 0
    while k < len(coefficients) and len(coefficients) > 1:
        without = np.delete(coefficients, k, axis=0)
        charges = np.any(without[:, _GROWS_WITH_TOKENS] > 0)
        if charges and _loss(without, x, y) <= loss * (1 + 1e-6) + 1e-12:
            coefficients = without
        else:
            k += 1
    return coefficients


def r2_score(predicted: np.ndarray, measured: np.ndarray) -> float:
    residual = float(np.sum((measured - predicted) ** 2))
    total = float(np.sum((measured - measured.mean()) ** 2))
    return 1.0 - residual / total if total > 0 else float("nan")


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error as a fraction (0.05 = 5%)."""
    return float(np.mean(np.abs(predicted - measured) / measured))


def score(terms: Sequence[Term], samples: Sequence[Sample]) -> tuple[float, float]:
    """(R^2, MAPE) of max-over-terms predictions on the samples."""
    x, measured = _design(samples)
    coefficients = np.array([t.coefficients for t in terms])
    predicted = _predict(coefficients, x)
    return r2_score(predicted, measured), mape(predicted, measured)


def split_samples(
    samples: Sequence[Sample], holdout_fraction: float = 0.25, seed: int = 0
) -> tuple[list[Sample], list[Sample]]:
    """A seeded random (train, held-out) split."""
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    order = np.random.default_rng(seed).permutation(len(samples))
    cut = len(samples) - max(1, round(holdout_fraction * len(samples)))
    return [samples[i] for i in order[:cut]], [samples[i] for i in order[cut:]]


def fit_profile(
    samples: Sequence[Sample],
    *,
    backend: str,
    device: str,
    model: str,
    draft: str | None = None,
    dtype: str = "bfloat16",
    tp: int = 1,
    date: str = "",
    notes: tuple[str, ...] = (),
    max_terms: int = 3,
    holdout_fraction: float = 0.25,
    seed: int = 0,
) -> PerfModel:
    """A measured profile: fitted on a training split, r2 and mape from the held-out split."""
    train, test = split_samples(samples, holdout_fraction, seed)
    terms = fit_terms(train, max_terms)
    r2, error = score(terms, test)
    fit = {
        "method": "max-affine regression, NNLS per term, relative residuals",
        "max_terms": max_terms,
        "num_train": len(train),
        "num_test": len(test),
        "holdout_fraction": holdout_fraction,
        "seed": seed,
    }
    info = ProfileInfo(
        source="measured",
        backend=backend,
        device=device,
        model=model,
        draft=draft,
        dtype=dtype,
        tp=tp,
        date=date,
        r2=r2,
        mape=error,
        notes=notes,
        fit=fit,
    )
    return PerfModel(terms, info)
