"""Sampling: the distribution each request's parameters define, and seeded draws by position."""

from __future__ import annotations

import torch

from replica.request import GREEDY_BELOW, SamplingParams
from replica.sampling import (
    _POSITION_MIX,
    _SEED_MIX,
    LogitsShaper,
    noisy_choice,
    position_noise,
    sample,
    token_probs,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])


def test_greedy_is_a_point_mass_on_the_argmax() -> None:
    probs = token_probs(LOGITS, SamplingParams())
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]


def test_a_temperature_below_greedy_below_is_greedy() -> None:
    """vLLM's rule: dividing by a temperature near 0 overflows fp32 logits into NaN rows."""
    for temperature in (1e-40, GREEDY_BELOW / 2):
        probs = token_probs(LOGITS * 1e3, SamplingParams(temperature=temperature))
        assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_temperature_scales_logits_before_softmax() -> None:
    probs = token_probs(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(LOGITS / 2.0, dim=-1))


def test_top_k_keeps_the_k_most_likely() -> None:
    probs = token_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs[0, 2:], torch.zeros(3))
    assert torch.allclose(probs[0, :2], torch.softmax(LOGITS[0, :2], dim=-1))


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    full = torch.softmax(LOGITS, dim=-1)[0]
    min_p = float(full[2] / full[0]) + 1e-3  # token 2 just below the floor, token 1 above
    probs = token_probs(LOGITS, SamplingParams(temperature=1.0, min_p=min_p))
    assert torch.count_nonzero(probs).item() == 2
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum())


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


def shaper(
    params: SamplingParams, tokens: list[int], num_output: int, held_back: frozenset[int]
) -> LogitsShaper:
    return LogitsShaper(params, tokens, num_output, held_back, 5, torch.device("cpu"), 0)


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    """Prompt [0], output [1, 1, 2]: OpenAI's logit - count * frequency - presence."""
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    shaped = shaper(params, [0, 1, 1, 2], 3, frozenset()).shape(LOGITS)
    assert shaped.tolist() == [[2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.0, -1.0]]


def test_repetition_penalty_shrinks_every_seen_token_toward_unlikely() -> None:
    """Prompt [0], output [4]: positive logits divided, negative ones multiplied."""
    shaped = shaper(SamplingParams(repetition_penalty=2.0), [0, 4], 1, frozenset()).shape(LOGITS)
    assert torch.allclose(shaped, torch.tensor([[1.0, 1.0, 0.5, 0.0, -2.0]]))


def test_logit_bias_adds_and_min_tokens_holds_back_eos_and_stop_ids() -> None:
    """min_tokens counts the tokens appended since the shaper began (what a resume left)."""
    params = SamplingParams(logit_bias=((3, 5.0), (0, -100.0)), min_tokens=2, stop_token_ids=(2,))
    shaping = shaper(params, [0, 1], 1, frozenset({4, 2}))
    inf = float("inf")
    assert shaping.shape(LOGITS).tolist() == [[-98.0, 1.0, -inf, 5.0, -inf]]
    assert shaping.shape(LOGITS, [3, 1], start=2).tolist() == [[-98.0, 1.0, 0.5, 5.0, -1.0]]
    shaping.add([3])
    assert shaping.shape(LOGITS).tolist() == [[-98.0, 1.0, -inf, 5.0, -inf]]
    shaping.add([1])
    assert shaping.shape(LOGITS).tolist() == [[-98.0, 1.0, 0.5, 5.0, -1.0]]


def test_verify_rows_are_shaped_as_decoding_the_proposal_one_by_one() -> None:
    """Row i of a verify step follows the output plus the first i proposed tokens: equal to
    shaping each row alone after appending those tokens, or as a draft's row `start = i`."""
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5, min_tokens=2)
    proposal = [2, 2]
    rows = shaper(params, [0, 1], 1, frozenset({4})).shape(torch.cat([LOGITS] * 3), proposal)
    for i in range(3):
        grown = shaper(params, [0, 1], 1, frozenset({4}))
        grown.add(proposal[:i])
        assert torch.equal(rows[i : i + 1], grown.shape(LOGITS)), i
        drafting = shaper(params, [0, 1], 1, frozenset({4}))
        assert torch.equal(rows[i : i + 1], drafting.shape(LOGITS, proposal[:i], start=i)), i


def test_allowed_token_ids_leave_every_other_token_out() -> None:
    shaping = shaper(SamplingParams(allowed_token_ids=(1, 3)), [0], 0, frozenset())
    inf = float("inf")
    assert shaping.shape(LOGITS).tolist() == [[-inf, 1.0, -inf, 0.0, -inf]]


def test_seeds_that_share_their_low_bits_draw_different_noise() -> None:
    """torch's CPU generator keeps 32 bits of its seed: seeds 2^32 apart, or -1 beside 2^32 - 1,
    drew the same text. Seeds below 2^32 draw what they always did."""
    for a, b in ((5, 5 + 2**32), (-1, 2**32 - 1), (7, 7 + 2**40), (0, -1)):
        assert not torch.equal(position_noise(a, 3, 2, 64), position_noise(b, 3, 2, 64))
    generator = torch.Generator()
    generator.manual_seed((5 * _SEED_MIX + 3 * _POSITION_MIX) % 2**64)
    assert torch.equal(
        position_noise(5, 3, 1, 64)[0], torch.rand(64, generator=generator).log_().neg_()
    )
