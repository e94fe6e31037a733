"""What a client's record says of its SLO, per stage, from hand-made token times."""

from __future__ import annotations

from cluster.api import StageVerdict
from cluster.handle import stage_verdicts
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
