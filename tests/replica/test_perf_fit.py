from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from replica.perf_fit import (
    Sample,
    fit_profile,
    fit_terms,
    mape,
    nnls,
    r2_score,
    samples_from_json,
    samples_to_json,
    split_samples,
)
from replica.perf_model import FEATURES, BatchShape


def brute_force_nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The best least-squares solution over every support whose solution is non-negative."""
    best, best_residual = np.zeros(a.shape[1]), float(np.linalg.norm(b))
    for size in range(1, a.shape[1] + 1):
        for support in itertools.combinations(range(a.shape[1]), size):
            z = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if np.all(z >= 0):
                x = np.zeros(a.shape[1])
                x[list(support)] = z
                residual = float(np.linalg.norm(a @ x - b))
                if residual < best_residual - 1e-12:
                    best, best_residual = x, residual
    return best


@pytest.mark.parametrize("seed", range(5))
def test_nnls_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(30, 5))
    b = rng.normal(size=30)
    np.testing.assert_allclose(nnls(a, b), brute_force_nnls(a, b), atol=1e-9)


def test_nnls_recovers_exact_non_negative_solution_with_scaled_columns() -> None:
    rng = np.random.default_rng(3)
    a = rng.random((40, 4)) * np.array([1.0, 1e3, 1e6, 1e-3])
    truth = np.array([0.5, 0.0, 2e-6, 7.0])
    np.testing.assert_allclose(nnls(a, a @ truth), truth, rtol=1e-6, atol=1e-12)


TRUE_TERMS = np.array(
    [
        # memory-bound: weights floor, KV reads, draft steps, drafted tokens, draft KV
        [0.010, 0.0, 0.0, 0.0, 2e-7, 0.0, 1e-3, 2e-5, 1e-7],
        # compute-bound: per token, per request, attention pairs, padded slots, draft steps
        [0.002, 8e-5, 5e-6, 3e-9, 0.0, 1e-9, 1e-3, 2e-5, 1e-7],
    ]
)


def synthetic_samples(count: int, noise: float, seed: int) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        requests = int(rng.integers(1, 33))
        new = tuple(int(rng.choice([1, 1, 1, 8, 64, 512])) for _ in range(requests))
        context = tuple(int(rng.integers(0, 2000)) for _ in range(requests))
        steps = int(rng.integers(0, 4))
        features = BatchShape(new, context, steps, requests if steps else 0).features()
        seconds = float((TRUE_TERMS @ np.array(features.vector())).max())
        samples.append(Sample(features, seconds * (1 + noise * rng.normal())))
    return samples


def test_fit_recovers_known_coefficients() -> None:
    terms = fit_terms(synthetic_samples(300, noise=0.0, seed=0), max_terms=3)
    assert len(terms) == 2
    fitted = sorted((np.array(t.coefficients) for t in terms), key=lambda c: -c[0])
    for got, want in zip(fitted, TRUE_TERMS, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-12)


def test_fit_profile_scores_the_held_out_split() -> None:
    samples = synthetic_samples(400, noise=0.03, seed=1)
    model = fit_profile(
        samples, backend="test", device="cpu", model="toy", holdout_fraction=0.25, seed=0
    )
    assert model.info.source == "measured"
    assert model.info.fit["num_test"] == 100
    assert model.info.fit["num_train"] == 300
    assert model.info.r2 is not None and model.info.r2 >= 0.98
    assert model.info.mape is not None and model.info.mape <= 0.05
    assert all(c >= 0 for t in model.terms for c in t.coefficients)


def test_split_is_seeded_and_disjoint() -> None:
    samples = synthetic_samples(20, noise=0.0, seed=2)
    train, test = split_samples(samples, 0.25, seed=7)
    again_train, again_test = split_samples(samples, 0.25, seed=7)
    assert (train, test) == (again_train, again_test)
    assert len(test) == 5 and len(train) == 15
    assert {id(s) for s in train}.isdisjoint({id(s) for s in test})


def test_scores() -> None:
    measured = np.array([1.0, 2.0, 3.0])
    assert r2_score(measured, measured) == 1.0
    assert mape(np.array([1.1, 1.8, 3.0]), measured) == pytest.approx((0.1 + 0.1) / 3)


def test_fit_rejects_too_few_samples_and_bad_samples() -> None:
    with pytest.raises(ValueError, match=f"at least {len(FEATURES)} samples"):
        fit_terms(synthetic_samples(3, noise=0.0, seed=0))
    features = BatchShape((1,), (0,)).features()
    with pytest.raises(ValueError, match="seconds must be finite and > 0"):
        Sample(features, 0.0)
    with pytest.raises(ValueError, match="holdout_fraction"):
        split_samples(synthetic_samples(10, noise=0.0, seed=0), 1.0)


def test_fit_refuses_times_that_do_not_grow_with_tokens() -> None:
    flat = [Sample(s.features, 0.01) for s in synthetic_samples(20, noise=0.0, seed=4)]
    with pytest.raises(ValueError, match="no fit charges for tokens"):
        fit_terms(flat)


def test_samples_json_round_trip() -> None:
    samples = synthetic_samples(10, noise=0.0, seed=5)
    assert samples_from_json(json.loads(json.dumps(samples_to_json(samples)))) == samples
