"""KV reservations from observed output lengths."""

from __future__ import annotations

import pytest

from replica.planner.config import OutputEstimateConfig, PlannerConfig
from replica.planner.output_estimate import OutputLengthEstimate
from replica.request import SLO, Request, SamplingParams


def request(prompt: int, max_tokens: int) -> Request:
    return Request("r", [0] * prompt, SamplingParams(max_tokens=max_tokens), SLO(1000.0, 100.0))


def test_reserves_the_prior_until_enough_outputs_with_that_cap_finished() -> None:
    config = OutputEstimateConfig(quantile=0.5, min_samples=3, prior_tokens=300, chunk_tokens=512)
    estimate = OutputLengthEstimate(config)
    chat, other = request(100, 400), request(100, 50)
    for length in (10, 30):
        estimate.observe(chat, length)
    assert estimate.expected_output(chat) == 300
    assert estimate.initial_tokens(chat) == 100 + 300 - 1
    estimate.observe(chat, 20)
    assert estimate.expected_output(chat) == 20
    assert estimate.initial_tokens(chat) == 100 + 20 - 1
    assert estimate.expected_output(other) == 50


def test_extensions_add_an_estimate_and_stop_at_the_peak() -> None:
    config = OutputEstimateConfig(quantile=1.0, min_samples=1, extension_tokens=512)
    estimate = OutputLengthEstimate(config)
    chat = request(100, 400)
    estimate.observe(chat, 150)
    assert estimate.extended_tokens(chat, 249) == 399
    assert estimate.extended_tokens(chat, 399) == 499
    assert estimate.extended_tokens(chat, 499) == 499


def test_long_outputs_reserve_and_extend_a_chunk_at_a_time() -> None:
    config = OutputEstimateConfig(
        quantile=1.0, min_samples=1, chunk_tokens=100, extension_tokens=100
    )
    estimate = OutputLengthEstimate(config)
    think = request(50, 8000)
    estimate.observe(think, 6000)
    assert estimate.expected_output(think) == 6000
    assert estimate.initial_tokens(think) == 50 + 100 - 1
    assert estimate.extended_tokens(think, 149) == 249
    assert estimate.extended_tokens(think, 8000) == 8049


def test_extensions_are_smaller_than_the_first_reservation() -> None:
    estimate = OutputLengthEstimate(OutputEstimateConfig(quantile=1.0, min_samples=1))
    chat = request(100, 1000)
    estimate.observe(chat, 600)
    assert estimate.initial_tokens(chat) == 100 + 128 - 1
    assert estimate.extended_tokens(chat, 227) == 227 + 32
    estimate = OutputLengthEstimate(OutputEstimateConfig(quantile=1.0, min_samples=1))
    short = request(100, 1000)
    estimate.observe(short, 20)
    assert estimate.initial_tokens(short) == 100 + 20 - 1
    assert estimate.extended_tokens(short, 119) == 119 + 20


def test_the_window_forgets_old_outputs() -> None:
    estimate = OutputLengthEstimate(OutputEstimateConfig(quantile=1.0, min_samples=1, window=2))
    chat = request(10, 400)
    for length in (300, 5, 7):
        estimate.observe(chat, length)
    assert estimate.expected_output(chat) == 7


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quantile": 1.5}, "quantile"),
        ({"min_samples": 0}, "min_samples"),
        ({"window": 0}, "window"),
        ({"prior_tokens": 0}, "prior_tokens"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"extension_tokens": 0}, "extension_tokens"),
    ],
)
def test_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OutputEstimateConfig(**kwargs)
    with pytest.raises(ValueError, match="output_estimate"):
        PlannerConfig(output_estimate=0.9)  # type: ignore[arg-type]


def test_expected_remaining_is_the_mean_residual_of_longer_finished_outputs() -> None:
    estimate = OutputLengthEstimate(OutputEstimateConfig(min_samples=3, prior_tokens=300))
    chat = request(100, 400)
    assert estimate.expected_remaining(chat, 100) == 200, "the prior until enough finished"
    assert estimate.expected_remaining(chat, 350) == 50, "past the prior: up to max_tokens"
    assert estimate.expected_remaining(chat, 400) == 1
    for length in (10, 50, 90, 200):
        estimate.observe(chat, length)
    assert estimate.expected_remaining(chat, 0) == round((10 + 50 + 90 + 200) / 4)
    assert estimate.expected_remaining(chat, 50) == round((90 + 200) / 2) - 50
    assert estimate.expected_remaining(chat, 199) == 1
    assert estimate.expected_remaining(chat, 200) == 200, "none longer: up to max_tokens"
    estimate.observe(chat, 390)
    assert estimate.expected_remaining(chat, 200) == 190
