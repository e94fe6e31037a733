"""Sampling: the distribution each request's parameters define, and seeded draws by position."""

from __future__ import annotations

import torch

from replica.request import SamplingParams
from replica.sampling import noisy_choice, position_noise, sample, token_probs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_a_point_mass_on_the_argmax() -> None:
    probs = token_probs(LOGITS, SamplingParams())
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_temperature_scales_logits_before_softmax() -> None:
    probs = token_probs(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(LOGITS / 2.0, dim=-1))


def test_top_k_keeps_the_k_most_likely() -> None:
    probs = token_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs[0, 2:], torch.zeros(3))
    assert torch.allclose(probs[0, :2], torch.softmax(LOGITS[0, :2], dim=-1))


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    full = torch.softmax(LOGITS, dim=-1)[0]
    top_two = float(full[0] + full[1])
    probs = token_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_two - 1e-3))
    assert torch.count_nonzero(probs).item() == 2
    assert torch.allclose(probs[0, :2], full[:2] / top_two)


def test_same_generator_seed_same_tokens_other_seed_other_tokens() -> None:
    probs = torch.softmax(torch.zeros(1, 1000), dim=-1)
    draws = [sample(probs.expand(8, -1), torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def seeded_choice(probs: torch.Tensor, seed: int, position: int) -> list[int]:
    """Row i of `probs` drawn at sequence position `position + i`."""
    return noisy_choice(probs, position_noise(seed, position, probs.shape[0], probs.shape[-1]))


def test_a_seeded_draw_is_fixed_by_seed_and_position_alone() -> None:
    probs = torch.softmax(torch.zeros(1, 1000), dim=-1).expand(6, -1)
    draws = seeded_choice(probs, 7, 40)
    assert draws == seeded_choice(probs, 7, 40)
    assert seeded_choice(probs[2:], 7, 42) == draws[2:]  # row i is position 40 + i
    assert seeded_choice(probs, 8, 40) != draws
    assert seeded_choice(probs, -8, 40) != seeded_choice(probs, 8, 40)
    assert len(set(draws)) > 1


def test_seeded_draws_follow_the_distribution() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0]])
    draws = [seeded_choice(probs, seed, 17)[0] for seed in range(4000)]
    shares = [draws.count(token) / len(draws) for token in range(5)]
    assert shares[3] == shares[4] == 0.0
    for share, p in zip(shares, [0.5, 0.3, 0.2], strict=False):
        assert abs(share - p) < 0.03, shares
