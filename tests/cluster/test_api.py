"""What a client's record says of its SLO, per stage, from hand-made token times."""

from __future__ import annotations

from cluster.api import StageVerdict, stage_verdicts
from replica.request import SLO, Request, SamplingParams, Stage, Tier

THINK_THEN_ANSWER = SLO(
    ttft_ms=1000,
    tpot_ms=200,
    stages=(Stage(tpot_ms=50, num_tokens=3, name="think"), Stage(tpot_ms=200, name="answer")),
)
"""Token j due by 1.0, 1.05, 1.1, then 1.3, 1.5 s after arrival."""


def test_each_stage_counts_its_late_tokens_by_the_deadline_line() -> None:
    request = Request("r", [1, 2], SamplingParams(max_tokens=5), THINK_THEN_ANSWER, arrival_time=10)
    times = [10.9, 11.1, 11.1, 11.31, 11.4]  # tokens 1 and 3 late, token 2 right on time
    assert stage_verdicts(request, [7] * 5, times) == (
        StageVerdict("think", False, 1, 3),
        StageVerdict("answer", False, 1, 2),
    )
    on_time = [10.9, 11.0, 11.1 + 5e-10, 11.2, 11.3]  # within a nanosecond is on time
    assert all(v.attained for v in stage_verdicts(request, [7] * 5, on_time))


def test_a_stage_cut_short_and_a_request_without_an_slo() -> None:
    request = Request("r", [1, 2], SamplingParams(max_tokens=5), THINK_THEN_ANSWER, arrival_time=0)
    assert stage_verdicts(request, [7, 7], [0.5, 1.2]) == (
        StageVerdict("think", False, 1, 2),
        StageVerdict("answer", True, 0, 0),
    )
    free = Request("f", [1], SamplingParams(max_tokens=2), tier=Tier.BEST_EFFORT)
    assert stage_verdicts(free, [7, 7], [100.0, 200.0]) == ()


def test_an_output_cut_short_misses_the_stage_of_a_token_due_before_the_cut() -> None:
    """Its client left (or its replica was lost) after two tokens: the third, due 1.1 s after
    arrival, misses "think" if it was due by then; never when every token came, or without
    an SLO. A stage the output never reached is not judged."""
    request = Request("r", [1, 2], SamplingParams(max_tokens=5), THINK_THEN_ANSWER, arrival_time=0)
    tokens, times = [7, 7], [0.9, 1.0]
    assert stage_verdicts(request, tokens, times, cut_at=1.1) == (
        StageVerdict("think", True, 0, 2),
    )
    assert stage_verdicts(request, tokens, times, cut_at=1.2) == (
        StageVerdict("think", False, 0, 2),
    )
    assert stage_verdicts(request, [], [], cut_at=1.5) == (StageVerdict("think", False, 0, 0),)
    assert stage_verdicts(request, [], [], cut_at=0.5) == ()
    three = [0.9, 1.0, 1.1]  # the fourth, due at 1.3, is the answer's first
    assert stage_verdicts(request, [7] * 3, three, cut_at=1.4) == (
        StageVerdict("think", True, 0, 3),
        StageVerdict("answer", False, 0, 0),
    )
    every = [0.9, 1.0, 1.1, 1.3, 1.5]
    assert all(v.attained for v in stage_verdicts(request, [7] * 5, every, cut_at=99.0))
    free = Request("f", [1], SamplingParams(max_tokens=2), tier=Tier.BEST_EFFORT)
    assert stage_verdicts(free, [], [], cut_at=99.0) == ()
