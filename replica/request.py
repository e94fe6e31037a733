"""Domain types every layer shares: what a request asks for and what it is promised.

Validation lives here, once, so the HTTP door, the gRPC door, the Python API and the simulator
all refuse the same bad input with the same message naming the field at fault.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
"""Most alternatives a token's log-probabilities may list (vLLM's default cap)."""
MAX_LOGIT_BIAS = 300
"""Most tokens one request may bias (OpenAI's cap)."""
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 128
"""Most token sequences `bad_words` may ban (each word counts twice: with and without a
leading space)."""
MAX_BAD_WORD_TOKENS = 64
MAX_GRAMMAR_CHARS = 65536
"""Longest structured-output grammar a request may carry (a JSON schema, regex, choice list
or grammar as llguidance text): the door compiles it on its event loop to check it."""
MAX_LATENCY_MS = 24 * 3600 * 1000.0
MAX_STAGE_END_TOKENS = 16
"""Most tokens that may end one SLO stage."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (vLLM's rule): dividing fp32 logits by one below
about 1e-37 overflows them, and the NaN rows crashed the whole batch's step (or, seeded, gave
EOS at once)."""

REPETITION_PENALTY_RANGE = (0.01, 100.0)
"""A seen token's logit is divided or multiplied by the penalty. Below about 3e-39 the fp32
factor overflowed, and the NaN rows aborted the request (or, seeded, gave EOS at once); 100x
either way keeps the logits, after the temperature's division too, far inside fp32."""


def _check_number(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_between(name: str, value: float, low: float, high: float) -> None:
    _check_number(name, value)
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")


def _check_finite(name: str, value: float, *, positive: bool, upper: float | None = None) -> None:
    _check_number(name, value)
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be <= {upper:g}, got {value!r}")


def _check_int(name: str, value: int, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Tier(StrEnum):
    """Service tier: SLO requests are admitted only when guaranteed; best-effort use leftovers."""

    SLO = "slo"
    BEST_EFFORT = "best_effort"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI / vLLM semantics)."""

    max_tokens: int = 16
    """Most output tokens; the planner reserves memory for all of them."""
    temperature: float = 0.0
    """Below `GREEDY_BELOW` (0 included) means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (vLLM); 0 disables it."""
    seed: int | None = None
    """Same seed, same output, whatever the batching or speculation (replica.sampling)."""
    stop: tuple[str, ...] = ()
    """Strings that end generation (not included in the output)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Report each output token's log-probability and those of the `logprobs` most likely
    tokens (0: the token's own only); None: none."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output already holds (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output already holds it (OpenAI)."""
    repetition_penalty: float = 1.0
    """Divides positive logits and multiplies negative ones of every token the prompt or the
    output holds (vLLM, after Keskar et al.); 1 is off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (OpenAI)."""
    min_tokens: int = 0
    """No stop condition ends the output before this many tokens; EOS and `stop_token_ids`
    cannot be drawn before then (vLLM)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the output, like EOS: counted and kept in the ids, not in the text."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be drawn (vLLM); empty: any."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """Token sequences the output may not contain (vLLM's bad_words, tokenized at the door):
    a sequence's last token cannot be drawn where the output ends with the rest of it."""
    include_stop_str_in_output: bool = False
    """Keep the stop string, or the stop token's text, at the end of the text (vLLM)."""
    prompt_logprobs: int | None = None
    """Report each prompt token's log-probability given the tokens before it (the first has
    none) and those of the `prompt_logprobs` most likely tokens; None: none. Costs the LM
    head over every prompt position, which the perf model does not charge."""
    grammar: str | None = None
    """Structured output: an llguidance grammar (the door builds it from a JSON schema, a
    regex, a choice list or a Lark/GBNF grammar) every output token must follow; the output
    ends when the grammar is complete. Checking it costs a token mask per sampled row, which
    the perf model does not charge."""

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_finite("temperature", self.temperature, positive=False, upper=100.0)
        _check_finite("top_p", self.top_p, positive=True, upper=1.0)
        _check_int("top_k", self.top_k, low=0)
        _check_between("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-MAX_SEED - 1, high=MAX_SEED)
        if isinstance(self.stop, str) or not isinstance(self.stop, Sequence):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entries must be non-empty strings, got {s!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        _check_between("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_between("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_between("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        self._check_logit_bias()
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        self._check_token_ids("stop_token_ids", MAX_STOP_TOKEN_IDS)
        self._check_token_ids("allowed_token_ids", None)
        self._check_bad_words()
        if self.grammar is not None and not (
            isinstance(self.grammar, str) and 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS
        ):
            raise ValueError(f"grammar must be a string of 1..{MAX_GRAMMAR_CHARS} characters")

    def _check_token_ids(self, name: str, most: int | None) -> None:
        """A list field of token ids, stored as a tuple (the vocabulary is checked with the
        prompt's, `Request.check_fits`)."""
        ids = getattr(self, name)
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
        object.__setattr__(self, name, tuple(ids))
        if most is not None and len(ids) > most:
            raise ValueError(f"{name} may hold at most {most} ids")
        if not all(_is_token_id(t) for t in ids):
            raise ValueError(f"{name} must hold non-negative integers, got {ids!r}")

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if isinstance(words, str) or not isinstance(words, Sequence):
            raise ValueError(f"bad_words must be token id sequences, got {words!r}")
        if len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} token sequences")
        for word in words:
            if (
                isinstance(word, str)
                or not isinstance(word, Sequence)
                or not 0 < len(word) <= MAX_BAD_WORD_TOKENS
                or not all(_is_token_id(t) for t in word)
            ):
                raise ValueError(
                    f"bad_words entries must be 1..{MAX_BAD_WORD_TOKENS} token ids, got {word!r}"
                )
        object.__setattr__(self, "bad_words", tuple(tuple(word) for word in words))

    def _check_logit_bias(self) -> None:
        pairs = self.logit_bias
        if not isinstance(pairs, Sequence) or isinstance(pairs, str):
            raise ValueError(f"logit_bias must be (token id, bias) pairs, got {pairs!r}")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens")
        for pair in pairs:
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"logit_bias entries must be (token id, bias), got {pair!r}")
            if not _is_token_id(pair[0]):
                raise ValueError(
                    f"logit_bias token ids must be non-negative integers, got {pair[0]!r}"
                )
            _check_between("logit_bias value", pair[1], -100.0, 100.0)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in pairs))
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def shapes_logits(self) -> bool:
        """Whether a grammar, a bias, a penalty or min_tokens changes the logits before
        sampling (`replica.sampling.LogitsShaper`); most requests skip that work."""
        return bool(
            self.grammar
            or self.bad_words
            or self.logit_bias
            or self.allowed_token_ids
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )


@dataclass(frozen=True)
class Stage:
    """One stage of a multi-stage SLO, e.g. a reasoning model's thinking, then its answer.

    The stage covers the next `num_tokens` output tokens (None: all that remain), or ends
    sooner with the first of its `end_token_ids` the model outputs: a reasoning model's
    end-of-thinking token, whose place nobody knows in advance. Its first token is due
    `ttft_ms` after the previous stage's last deadline (default: one `tpot_ms`).
    """

    tpot_ms: float
    num_tokens: int | None = None
    ttft_ms: float | None = None
    name: str = ""
    end_token_ids: tuple[int, ...] = ()
    """The stage ends with (and includes) the first of these tokens; until then every token
    counts in it, up to `num_tokens` if set (SLO.closed_by)."""

    def __post_init__(self) -> None:
        _check_finite("stages[].tpot_ms", self.tpot_ms, positive=True, upper=MAX_LATENCY_MS)
        if self.num_tokens is not None:
            _check_int("stages[].num_tokens", self.num_tokens, low=1)
        if self.ttft_ms is not None:
            _check_finite("stages[].ttft_ms", self.ttft_ms, positive=False, upper=MAX_LATENCY_MS)
        ends = self.end_token_ids
        if isinstance(ends, str | bytes) or not isinstance(ends, Sequence):
            raise ValueError(f"stages[].end_token_ids must be a list of token ids, got {ends!r}")
        object.__setattr__(self, "end_token_ids", tuple(ends))
        if len(self.end_token_ids) > MAX_STAGE_END_TOKENS:
            raise ValueError(
                f"stages[].end_token_ids may list at most {MAX_STAGE_END_TOKENS} tokens, "
                f"got {len(self.end_token_ids)}"
            )
        bad = next((t for t in self.end_token_ids if not _is_token_id(t)), None)
        if bad is not None:
            raise ValueError(f"stages[].end_token_ids must be token ids >= 0, got {bad!r}")


@dataclass(frozen=True)
class SLO:
    """Latency targets with deadline semantics.

    Token j (0-based) is on time if it arrives by arrival + ttft + j * tpot; early tokens bank
    slack. With stages, the first stage starts at token 0 (due at ttft) and each later stage
    restarts the line from the previous stage's last deadline. A stage that ends on a token
    stays open until the model outputs it: until then the tokens to come count in it.
    """

    ttft_ms: float
    tpot_ms: float
    stages: tuple[Stage, ...] = ()

    def __post_init__(self) -> None:
        _check_finite("slo.ttft_ms", self.ttft_ms, positive=True, upper=MAX_LATENCY_MS)
        _check_finite("slo.tpot_ms", self.tpot_ms, positive=True, upper=MAX_LATENCY_MS)
        object.__setattr__(self, "stages", tuple(self.stages))
        for i, stage in enumerate(self.stages):
            if not isinstance(stage, Stage):
                raise ValueError(f"slo.stages[{i}] must be a Stage, got {stage!r}")
            if stage.num_tokens is None and not stage.end_token_ids and i != len(self.stages) - 1:
                raise ValueError(
                    f"slo.stages[{i}] needs num_tokens or end_token_ids (only the last stage "
                    "may run to the end of the output)"
                )
        for i in range(1, len(self.stages)):
            gap = self.stages[i].ttft_ms
            # While in the stage before, the planner paces the request at the tightest TPOT
            # from that stage on (deadlines.remaining_tpot): the most it can promise.
            paced = self.tightest_tpot_ms(i - 1)
            if self.stages[i - 1].end_token_ids and gap is not None and gap < paced:
                raise ValueError(
                    f"slo.stages[{i}].ttft_ms ({gap:g}) must be at least the tightest TPOT "
                    f"from slo.stages[{i - 1}] on ({paced:g}): that stage ends on a token, "
                    "which no plan can foresee, so the first token after it cannot be "
                    "promised sooner"
                )

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The tokens that may end a stage (`closed_by` may change this SLO); a stage over by
        its count keeps its own, which then end nothing."""
        return tuple(t for stage in self.stages for t in stage.end_token_ids)

    def closed_by(self, output: Sequence[int], since: int = 0) -> SLO:
        """This SLO once the model output `output` (its tokens from position `since` on are
        new: the earlier ones were seen). Every holder of a request (replica, controller
        mirror, client handle, simulator) closes it from the same tokens, so they agree on
        every later deadline."""
        ends = self.end_token_ids
        if not ends:
            return self
        return self.after_tokens(
            (j, output[j]) for j in range(since, len(output)) if output[j] in ends
        )

    def after_tokens(self, tokens: Iterable[tuple[int, int]]) -> SLO:
        """This SLO once the model output these (position, token id), in order: a stage
        whose end token comes within it ends there, its `num_tokens` fixed and its end tokens
        dropped."""
        slo = self
        for position, token in tokens:
            i = slo.stage_at(position)
            if not slo.stages or token not in slo.stages[i].end_token_ids:
                continue
            ended = replace(
                slo.stages[i], num_tokens=position + 1 - slo.stage_start(i), end_token_ids=()
            )
            slo = replace(slo, stages=(*slo.stages[:i], ended, *slo.stages[i + 1 :]))
        return slo

    def _pieces(self) -> list[tuple[int | None, float, float]]:
        """(tokens, tpot_s, gap before the first token of the piece, seconds)."""
        if not self.stages:
            return [(None, self.tpot_ms / 1e3, self.ttft_ms / 1e3)]
        pieces: list[tuple[int | None, float, float]] = []
        for i, st in enumerate(self.stages):
            gap = self.ttft_ms if i == 0 else (st.ttft_ms if st.ttft_ms is not None else st.tpot_ms)
            pieces.append((st.num_tokens, st.tpot_ms / 1e3, gap / 1e3))
        if pieces[-1][0] is not None:
            last_tpot = self.stages[-1].tpot_ms / 1e3
            pieces.append((None, last_tpot, last_tpot))
        return pieces

    def deadline_s(self, j: int) -> float:
        """Seconds after arrival by which output token j (0-based) must be out."""
        if not self.stages:  # the one piece of `_pieces`, without building it
            return self.ttft_ms / 1e3 + j * (self.tpot_ms / 1e3)
        t = 0.0
        start = 0
        for count, tpot, gap in self._pieces():
            t += gap
            if count is None or j < start + count:
                return t + (j - start) * tpot
            t += (count - 1) * tpot
            start += count
        raise AssertionError("the last piece is unbounded")

    def tightest_tpot_ms(self, from_stage: int = 0) -> float:
        """The tightest TPOT of stage `from_stage` and the stages after it (the SLO's own
        without stages: with them, theirs set every deadline)."""
        if not self.stages:
            return self.tpot_ms
        return min(stage.tpot_ms for stage in self.stages[from_stage:])

    def stage_start(self, i: int) -> int:
        """Output position of stage i's first token, by the counts of the stages before it."""
        return sum(stage.num_tokens or 0 for stage in self.stages[:i])

    def stage_at(self, j: int) -> int:
        """Index of the stage output token j belongs to (0 without stages)."""
        start = 0
        for i, st in enumerate(self.stages):
            if st.num_tokens is None or j < start + st.num_tokens:
                return i
            start += st.num_tokens
        return max(0, len(self.stages) - 1)

    def tpot_at(self, j: int) -> float:
        """TPOT in seconds that governs output token j."""
        if not self.stages:
            return self.tpot_ms / 1e3
        return self.stages[self.stage_at(j)].tpot_ms / 1e3


@dataclass
class Request:
    """One generation request as the scheduler and engine see it.

    The prompt is token ids: tokenization happens at the door, so every layer below is
    tokenizer-free and the simulator can run on lengths alone.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slo: SLO | None = None
    tier: Tier = Tier.SLO
    arrival_time: float = 0.0
    value: float = 1.0
    """Admission weight (e.g. from priority); the DP maximizes the admitted total."""
    model: str = ""
    resumed_output: int = 0
    """How many of the prompt's last tokens are this request's own earlier output (it was
    resumed on another replica, cluster.migration, which takes them off max_tokens and
    min_tokens): penalties and stop strings count them as output, so the request goes on as it
    would have where it began."""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.prompt_token_ids, list | tuple) or not self.prompt_token_ids:
            raise ValueError("prompt must not be empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        # In bulk first (a simulation builds requests by the thousand, prompts by the
        # thousand tokens); one by one only to name the bad id.
        ids = self.prompt_token_ids
        if not ({*map(type, ids)} == {int} and min(ids) >= 0):
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"prompt token ids must be non-negative integers, got {t!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if self.slo is not None and not isinstance(self.slo, SLO):
            raise ValueError(f"slo must be an SLO, got {type(self.slo).__name__}")
        self.tier = Tier(self.tier)
        if self.tier is Tier.SLO and self.slo is None:
            raise ValueError("slo is required for tier 'slo' (use tier 'best_effort' without one)")
        _check_finite("arrival_time", self.arrival_time, positive=False)
        _check_finite("value", self.value, positive=True, upper=1e6)
        _check_int("resumed_output", self.resumed_output, low=0, high=len(ids) - 1)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def check_fits(self, max_model_len: int, vocab_size: int | None = None) -> None:
        """Refuse what the model cannot hold: prompt + max_tokens beyond its context."""
        total = self.prompt_len + self.sampling.max_tokens
        if self.prompt_len >= max_model_len:
            raise ValueError(
                f"prompt has {self.prompt_len} tokens; the model context is {max_model_len}"
            )
        if total > max_model_len:
            raise ValueError(
                f"max_tokens={self.sampling.max_tokens} with a {self.prompt_len}-token prompt "
                f"exceeds the model context of {max_model_len} tokens"
            )
        if vocab_size is None:
            return
        params = self.sampling
        for name, ids in (
            ("prompt", self.prompt_token_ids),
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
            ("slo.stages[].end_token_ids", self.slo.end_token_ids if self.slo else ()),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", [t for word in params.bad_words for t in word]),
        ):
            check_in_vocab(name, ids, vocab_size)


def check_in_vocab(name: str, ids: Iterable[int], vocab_size: int) -> None:
    """Refuse token ids the model does not have, naming where the first one is."""
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name} token id {bad} is outside the vocabulary ({vocab_size})")
