"""Validation of the domain types: every bad field is refused with its name in the message."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from replica.request import SLO, Request, SamplingParams, Stage, Tier

BAD_FLOATS = st.one_of(
    st.just(math.nan),
    st.just(math.inf),
    st.just(-math.inf),
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=3),
)


def make(**kw: object) -> Request:
    args: dict[str, object] = {
        "request_id": "r",
        "prompt_token_ids": [1, 2, 3],
        "slo": SLO(ttft_ms=100, tpot_ms=50),
    }
    args.update(kw)
    return Request(**args)  # type: ignore[arg-type]


@given(BAD_FLOATS)
def test_slo_ttft_rejects_non_positive_and_non_finite(value: object) -> None:
    with pytest.raises(ValueError, match=r"slo\.ttft_ms"):
        SLO(ttft_ms=value, tpot_ms=50)  # type: ignore[arg-type]


@given(BAD_FLOATS)
def test_slo_tpot_rejects_non_positive_and_non_finite(value: object) -> None:
    with pytest.raises(ValueError, match=r"slo\.tpot_ms"):
        SLO(ttft_ms=100, tpot_ms=value)  # type: ignore[arg-type]


@given(st.floats(min_value=1e-3, max_value=1e6), st.floats(min_value=1e-3, max_value=1e6))
def test_valid_slo_accepted(ttft: float, tpot: float) -> None:
    slo = SLO(ttft_ms=ttft, tpot_ms=tpot)
    assert slo.deadline_s(0) == pytest.approx(ttft / 1e3)
    assert slo.deadline_s(10) == pytest.approx(ttft / 1e3 + 10 * tpot / 1e3)


@given(st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans()))
def test_max_tokens_must_be_positive_int(value: object) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=value)  # type: ignore[arg-type]


@given(st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.floats(min_value=100.01)))
def test_temperature_range(value: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


@given(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(math.nan)))
def test_top_p_range(value: float) -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=value)


@given(st.integers(max_value=-1))
def test_top_k_non_negative(value: int) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=value)


def test_seed_is_a_64_bit_integer_and_stop_entries() -> None:
    assert SamplingParams(seed=-1).seed == -1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", -2.01, r"frequency_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", "1", "frequency_penalty must be a number"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \[0.01, 100\]"),
        ("repetition_penalty", 1e-39, r"repetition_penalty must be in \[0.01, 100\]"),
        ("repetition_penalty", math.inf, "repetition_penalty must be finite"),
        ("logit_bias", ((5, 1.0), (5, 2.0)), "logit_bias names a token id twice"),
        ("logit_bias", ((5, 101.0),), r"logit_bias value must be in \[-100, 100\]"),
        ("logit_bias", ((-1, 1.0),), "logit_bias token ids must be non-negative integers"),
        ("logit_bias", ((5,),), "logit_bias entries must be"),
        ("logit_bias", ((1, 0.0),) * 301, "at most 300 tokens"),
        ("min_tokens", 17, "min_tokens must be <= 16"),
        ("stop_token_ids", 3, "stop_token_ids must be a list"),
        ("stop_token_ids", (3, True), "stop_token_ids"),
        ("allowed_token_ids", "12", "allowed_token_ids must be a list"),
        ("allowed_token_ids", (3, -1), "allowed_token_ids must hold non-negative integers"),
    ],
)
def test_penalties_bias_and_stop_conditions_are_checked(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_only_requests_that_shape_logits_say_so() -> None:
    assert not SamplingParams(
        repetition_penalty=1.0, logit_bias=(), stop_token_ids=(3,)
    ).shapes_logits
    for shaping in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"logit_bias": ((3, 0.0),)},
        {"min_tokens": 1},
        {"allowed_token_ids": (5,)},
    ):
        assert SamplingParams(**shaping).shapes_logits, shaping  # type: ignore[arg-type]
    assert SamplingParams(logit_bias=[[3, 1]]).logit_bias == ((3, 1.0),)  # type: ignore[arg-type]


def test_empty_prompt_and_bad_ids() -> None:
    with pytest.raises(ValueError, match="prompt must not be empty"):
        make(prompt_token_ids=[])
    with pytest.raises(ValueError, match="prompt token ids"):
        make(prompt_token_ids=[1, -2])
    for bad in (True, 2.0, "3"):
        with pytest.raises(ValueError, match=f"non-negative integers, got {bad!r}"):
            make(prompt_token_ids=[1, bad, 4])
    with pytest.raises(ValueError, match="request_id"):
        make(request_id="")


def test_slo_tier_needs_slo_and_best_effort_does_not() -> None:
    with pytest.raises(ValueError, match="slo is required"):
        make(slo=None)
    assert make(slo=None, tier="best_effort").tier is Tier.BEST_EFFORT
    with pytest.raises(ValueError):
        make(tier="gold")


@given(st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=64))
def test_check_fits_against_context(prompt_len: int, max_tokens: int) -> None:
    req = make(prompt_token_ids=[5] * prompt_len, sampling=SamplingParams(max_tokens=max_tokens))
    context = 64
    if prompt_len + max_tokens > context:
        with pytest.raises(ValueError, match="context"):
            req.check_fits(context)
    else:
        req.check_fits(context)


def test_check_fits_vocab() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        make(prompt_token_ids=[1, 9000]).check_fits(2048, vocab_size=4096)
    biased = make(sampling=SamplingParams(logit_bias=((4096, 1.0),)))
    with pytest.raises(ValueError, match="logit_bias token id 4096 is outside"):
        biased.check_fits(2048, vocab_size=4096)
    stopped = make(sampling=SamplingParams(stop_token_ids=(3, 5000)))
    with pytest.raises(ValueError, match="stop_token_ids token id 5000 is outside"):
        stopped.check_fits(2048, vocab_size=4096)


def test_resumed_output_lies_inside_the_prompt() -> None:
    assert make(prompt_token_ids=[1, 2, 3], resumed_output=2).resumed_output == 2
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match="resumed_output"):
            make(prompt_token_ids=[1, 2, 3], resumed_output=bad)


def test_stage_deadlines_piecewise() -> None:
    slo = SLO(
        ttft_ms=1000,
        tpot_ms=100,
        stages=(Stage(tpot_ms=10, num_tokens=5, name="think"), Stage(tpot_ms=100, name="answer")),
    )
    assert slo.deadline_s(0) == pytest.approx(1.0)
    assert slo.deadline_s(4) == pytest.approx(1.04)
    assert slo.deadline_s(5) == pytest.approx(1.14)
    assert slo.deadline_s(6) == pytest.approx(1.24)
    assert [slo.stage_at(j) for j in (0, 4, 5, 100)] == [0, 0, 1, 1]
    assert slo.tpot_at(3) == pytest.approx(0.01)
    assert slo.tpot_at(7) == pytest.approx(0.1)


def test_the_tightest_tpot_is_the_stages_when_there_are_stages() -> None:
    # The SLO's own 5 ms sets no deadline once it has stages.
    staged = SLO(
        ttft_ms=1000,
        tpot_ms=5,
        stages=(Stage(tpot_ms=10, num_tokens=5), Stage(tpot_ms=100, name="answer")),
    )
    assert [staged.tightest_tpot_ms(i) for i in (0, 1)] == [10, 100]
    assert staged.tightest_tpot_ms() == 10
    assert SLO(ttft_ms=1000, tpot_ms=5).tightest_tpot_ms() == 5


def test_stage_without_count_must_be_last() -> None:
    with pytest.raises(ValueError, match=r"needs num_tokens or end_token_ids"):
        SLO(ttft_ms=1, tpot_ms=1, stages=(Stage(tpot_ms=1), Stage(tpot_ms=2)))


THINK_END = 9


def thinking_slo(num_tokens: int | None = None) -> SLO:
    """1 s TTFT, thinking at 10 ms a token until THINK_END, then an answer at 100 ms."""
    think = Stage(tpot_ms=10, num_tokens=num_tokens, name="think", end_token_ids=(THINK_END,))
    return SLO(ttft_ms=1000, tpot_ms=10, stages=(think, Stage(tpot_ms=100, name="answer")))


def test_a_stage_that_ends_on_a_token_is_open_until_the_model_outputs_it() -> None:
    slo = thinking_slo()
    # Open: every token to come is planned in the thinking stage.
    assert [slo.stage_at(j) for j in (0, 5, 10_000)] == [0, 0, 0]
    assert slo.deadline_s(7) == pytest.approx(1.07)
    assert slo.end_token_ids == (THINK_END,)
    # Tokens without the end token change nothing; the end token at position 4 ends it.
    assert slo.closed_by([1, 2, 3]) is slo
    closed = slo.closed_by([1, 2, 3, 4, THINK_END, 5])
    assert closed.stages[0] == Stage(tpot_ms=10, num_tokens=5, name="think")
    assert closed.end_token_ids == ()
    # The answer's line starts one answer TPOT after the last thinking deadline.
    assert closed.deadline_s(4) == pytest.approx(1.04)
    assert closed.deadline_s(5) == pytest.approx(1.14)
    assert [closed.stage_at(j) for j in (4, 5)] == [0, 1]
    # The same end token later, in the answer, is an answer token.
    assert closed.closed_by([1, 2, 3, 4, THINK_END, 5, THINK_END]) == closed


def test_closing_reads_only_the_new_tokens_and_agrees_with_explicit_positions() -> None:
    slo = thinking_slo()
    output = [1, THINK_END, 2, THINK_END]
    # Tokens before `since` were seen: the first end token is not looked at again.
    later = slo.closed_by(output, since=2)
    assert later.stages[0].num_tokens == 4
    assert later == slo.after_tokens([(3, THINK_END)])
    assert slo.closed_by(output) == slo.after_tokens([(1, THINK_END)])
    # A position's token that ends no stage changes nothing.
    assert slo.after_tokens([(1, THINK_END + 1)]) is slo


def test_a_bounded_stage_ends_at_its_end_token_or_its_count_whichever_first() -> None:
    slo = thinking_slo(num_tokens=3)
    assert slo.closed_by([THINK_END]).stages[0].num_tokens == 1
    # Past the count the end token falls in the answer: the stage already ended.
    assert slo.closed_by([1, 2, 3, THINK_END]) == slo
    assert slo.stage_at(3) == 1


def test_stage_end_tokens_are_checked() -> None:
    with pytest.raises(ValueError, match="end_token_ids must be token ids"):
        Stage(tpot_ms=1, end_token_ids=(-1,))
    with pytest.raises(ValueError, match="end_token_ids must be a list"):
        Stage(tpot_ms=1, end_token_ids="</think>")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most 16"):
        Stage(tpot_ms=1, end_token_ids=tuple(range(17)))
    with pytest.raises(ValueError, match=r"slo.stages\[1\].ttft_ms \(5\) must be at least"):
        SLO(1000, 10, (Stage(10, end_token_ids=(9,)), Stage(100, ttft_ms=5)))
    # A boundary known in advance may bring the next stage forward (the planner chains it).
    assert SLO(1000, 10, (Stage(10, num_tokens=3), Stage(100, ttft_ms=5))).stages[1].ttft_ms == 5
    request = Request("r", [1, 2], slo=thinking_slo())
    with pytest.raises(ValueError, match=r"slo.stages\[\].end_token_ids token id 9 is outside"):
        request.check_fits(100, vocab_size=9)


@given(st.integers(min_value=0, max_value=500))
def test_deadlines_increase(j: int) -> None:
    slo = SLO(
        ttft_ms=200,
        tpot_ms=50,
        stages=(Stage(tpot_ms=20, num_tokens=30), Stage(tpot_ms=80, num_tokens=10, ttft_ms=500)),
    )
    assert slo.deadline_s(j + 1) > slo.deadline_s(j)
