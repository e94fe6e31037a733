"""Deadline semantics: token j is due by arrival + TTFT + the TPOTs of the tokens before it."""

from __future__ import annotations

from replica.planner.deadlines import late_tokens
from replica.request import SLO, Request, SamplingParams, Stage


def test_late_tokens_uses_deadline_semantics() -> None:
    request = Request("a", [1] * 4, SamplingParams(max_tokens=4), SLO(1000.0, 500.0))
    assert late_tokens(request, [1.0, 1.5, 2.0]) == []
    assert late_tokens(request, [0.2, 1.6, 1.7]) == [1]  # early tokens bank slack


def test_late_tokens_close_a_stage_where_the_output_ends_it() -> None:
    """Thinking (TPOT 10 ms) ends on token 9; the answer after it has 100 ms a token."""
    think = Stage(tpot_ms=10, end_token_ids=(9,), name="think")
    slo = SLO(ttft_ms=100, tpot_ms=100, stages=(think, Stage(tpot_ms=100, name="answer")))
    request = Request("a", [1], SamplingParams(max_tokens=8), slo)
    times = [0.1, 0.11, 0.2]
    assert late_tokens(request, times, [5, 9, 5]) == []
    assert late_tokens(request, times, [5, 5, 5]) == [2]  # still thinking: due by 0.12
