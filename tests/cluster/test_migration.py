"""Resuming a request: the shifted SLO keeps every remaining token's original deadline."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.migration import resumed_request, shift_slo
from replica.request import SLO, Request, SamplingParams, Stage, Tier

STAGED = SLO(
    ttft_ms=400,
    tpot_ms=50,
    stages=(Stage(20, 5, name="think"), Stage(80, 3, ttft_ms=300, name="answer")),
)


@given(
    slo=st.sampled_from(
        [SLO(ttft_ms=250, tpot_ms=40), STAGED, SLO(100, 10, stages=(Stage(10, 2), Stage(30)))]
    ),
    delivered=st.integers(0, 30),
)
def test_shifted_line_keeps_original_deadlines(slo: SLO, delivered: int) -> None:
    shifted = shift_slo(slo, delivered)
    for j in range(12):
        assert shifted.deadline_s(j) == pytest.approx(slo.deadline_s(j + delivered), abs=1e-9)


def test_shifted_stages_keep_their_tpot_and_name() -> None:
    shifted = shift_slo(STAGED, 6)
    assert [s.name for s in shifted.stages] == ["answer"]
    assert shifted.stages[0].num_tokens == 2
    assert shifted.tpot_at(0) == pytest.approx(0.08)


def test_resumed_request_continues_from_delivered_tokens() -> None:
    original = Request(
        "r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0.5), slo=STAGED, arrival_time=7.0
    )
    resumed = resumed_request(original, [9, 8, 7, 6])
    assert resumed.request_id == "r"
    assert resumed.prompt_token_ids == [1, 2, 3, 9, 8, 7, 6]
    assert resumed.sampling.max_tokens == 6
    assert resumed.sampling.temperature == 0.5
    assert resumed.arrival_time == 7.0
    assert resumed.slo is not None
    assert resumed.slo.deadline_s(0) == pytest.approx(STAGED.deadline_s(4))
    assert original.prompt_token_ids == [1, 2, 3]


def test_a_resume_after_the_model_ended_a_stage_goes_on_in_the_next() -> None:
    think = Stage(20, name="think", end_token_ids=(5,))
    slo = SLO(ttft_ms=400, tpot_ms=20, stages=(think, Stage(80, name="answer")))
    original = Request("r", [1], SamplingParams(max_tokens=10), slo=slo)
    ended = resumed_request(original, [9, 5, 7])
    assert ended.slo is not None
    assert [s.name for s in ended.slo.stages] == ["answer"]
    closed = slo.closed_by([9, 5])
    assert ended.slo.deadline_s(0) == pytest.approx(closed.deadline_s(3))
    # Still thinking: the stage stays open, to end on its token on the next replica.
    thinking = resumed_request(original, [9, 8])
    assert thinking.slo is not None and thinking.slo.stages[0].end_token_ids == (5,)
    assert thinking.slo.deadline_s(0) == pytest.approx(slo.deadline_s(2))
    # What follows the thinking is held to the thinking's pace, not to a tighter stage before
    # it: a gap between the two is refused up front rather than on a resume that drops it.
    first = Stage(10, num_tokens=2, name="plan")
    with pytest.raises(ValueError, match=r"tightest TPOT from slo.stages\[1\] on \(20\)"):
        SLO(400, 10, (first, think, Stage(80, ttft_ms=15, name="answer")))
    staged = SLO(400, 10, (first, think, Stage(80, ttft_ms=30, name="answer")))
    resumed = resumed_request(replace(original, slo=staged), [9, 8, 7])
    assert resumed.slo is not None and [s.name for s in resumed.slo.stages] == ["think", "answer"]


def test_a_resume_keeps_count_of_the_output_it_turned_into_prompt() -> None:
    """Penalties and stop strings count the delivered tokens as output; min_tokens, like
    max_tokens, counts only what is left."""
    params = SamplingParams(max_tokens=10, min_tokens=6, frequency_penalty=1.0)
    original = Request("r", [1, 2, 3], params, tier=Tier.BEST_EFFORT)
    once = resumed_request(original, [9, 8, 7, 6])
    assert (once.resumed_output, once.sampling.min_tokens, once.sampling.max_tokens) == (4, 2, 6)
    twice = resumed_request(once, [5, 4, 3])
    assert (twice.resumed_output, twice.sampling.min_tokens, twice.sampling.max_tokens) == (7, 0, 3)
    assert twice.prompt_token_ids[-twice.resumed_output :] == [9, 8, 7, 6, 5, 4, 3]


def test_prompt_log_probabilities_are_asked_again_until_the_first_token_came() -> None:
    """They go out with the first token: a replica lost before it owes them still."""
    params = SamplingParams(max_tokens=10, prompt_logprobs=2)
    original = Request("r", [1, 2, 3], params, tier=Tier.BEST_EFFORT)
    assert resumed_request(original, []).sampling.prompt_logprobs == 2
    assert resumed_request(original, [9]).sampling.prompt_logprobs is None


def test_resumed_best_effort_request_has_no_slo() -> None:
    original = Request("b", [1], SamplingParams(max_tokens=3), tier=Tier.BEST_EFFORT)
    assert resumed_request(original, [5]).slo is None


def test_nothing_left_to_resume_is_an_error() -> None:
    original = Request("r", [1], SamplingParams(max_tokens=2), slo=SLO(100, 10))
    with pytest.raises(ValueError, match="nothing is left"):
        resumed_request(original, [4, 5])
    with pytest.raises(ValueError, match="delivered"):
        shift_slo(SLO(100, 10), -1)
