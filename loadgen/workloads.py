"""The SLOs-Serve paper's scenarios as request generators: lengths, SLOs, and stages.

Scenarios (paper Tables 1, 3, 4): ChatBot, Coder, Summarizer, Mixed (the three, equal shares),
ToolLLM (rounds of tool calls), Reasoning (thinking, then answer). Each request gets:

- Lengths. Table 4 gives mean, p99 and std of prompt and output tokens; we sample a lognormal
  fitted to the mean and p99 (the load and the tail a planner must reserve for), rounded to
  integers and clipped to [1, cap] with cap = the fit's 99.9th percentile. Three numbers cannot all
  be met by two parameters; the std the fit yields (200k samples) vs Table 4:

      length            sigma  cap   mean  p99   std (Table 4)
      ChatBot prompt    0.341  2065   763  1594   267 (424)
      ChatBot output    0.397   839   266   618   109 (160)
      Coder prompt      0.407  2744   848  2019   359 (617)
      Coder output      1.309   631    26   233    48 (47)
      Summarizer prompt 0.169  2214  1333  1949   226 (444)
      Summarizer output 1.147  3622   201  1511   304 (234)
      ToolLLM prompt    0.550  3243   691  2140   407 (356)
      ToolLLM output    0.557   556   116   362    69 (66)
      Reasoning prompt  0.590   661   127   423    81 (83)
      thinking          0.198  8490  4692  7309   936 (1442)
      answer            0.333  2129   802  1641   273 (280)

  ChatBot and Coder can instead replay the logged lengths of the Azure trace rows they arrive
  with (`trace_rows`; CC-BY 4.0, see loadgen.traces), clipped to the same caps.
  `length_scale` shrinks every length (CPU demo runs): the fit is redone on the scaled mean/p99.
- SLOs (Table 1 picks the levels per stage; Table 2 the values): TTFT = slowdown x zero-load
  TTFT of the prompt (tight 3x, loose 5x); TPOT tight 50 ms, loose 100 ms on GPU profiles. On
  the CPU demo pair the TPOT levels scale from the profiled zero-load decode step: tight = 3.3x,
  loose = 6.6x, the ratios of 50/100 ms to the 15.1 ms zero-load step (763-token context) that
  deploy/profiles/a100-40gb-opt-7b-tp1.json predicts for the paper's main model (see
  SLOTargets.for_decode_step).
- max_tokens vs the true output length. The scheduler never sees how long an output will be:
  it plans and reserves memory for `max_tokens`, which is the scenario's output cap for every
  request. `output_len` (<= max_tokens) is when the request really ends, known only to the
  client side: the simulated backend ends the request there (as if the model emitted EOS), a
  real client sends max_tokens with ignore_eos (so a tiny model's stray EOS cannot shorten the
  run) and stops the request once output_len tokens have arrived.
- ToolLLM: a session is 1-3 tool-call rounds then a final answer (uniform; the paper gives no
  counts). Every round is its own request with a tight TTFT; tool calls decode at the tight TPOT,
  the answer at the loose one. A round's prompt is the previous prompt + its output + a tool
  response (lognormal, mean 128, p99 512 tokens: a choice). Follow-up rounds carry `follows`
  (the previous round's id) and `delay_s` (the tool latency): they are issued delay_s after that
  round's last token, because their real arrival depends on how fast the previous round ran;
  their `arrival_s` is the session's start, a lower bound.
- Reasoning: one request, SLO stages [thinking: tight TPOT, answer: loose TPOT]. The thinking
  stage ends on a token (`STAGE_END_TOKEN`, as a reasoning model's </think>): the simulated
  model outputs it after the sampled thinking length (`WorkloadRequest.emits`), and the planner
  learns where thinking ends only then, as it would live. The total output length stays hidden
  behind max_tokens = thinking cap + answer cap. A live run's demo model does not think, so a
  live client tells the server where the stage ends (`WorkloadRequest.judged_slo`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from statistics import NormalDist
from typing import Any, Protocol, TypeVar

import numpy as np

from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE, TraceRow
from replica.perf_model import BatchShape, PerfModel
from replica.planner.executor import OUTPUT_TOKENS
from replica.request import SLO, Request, SamplingParams, Stage, Tier

STAGE_END_TOKEN = OUTPUT_TOKENS
"""The token a simulated model outputs to end an SLO stage (a reasoning model's end of
thinking): one it never outputs otherwise."""

Z99 = NormalDist().inv_cdf(0.99)
CAP_QUANTILE = 0.999
CPU_TIGHT_TPOT_FACTOR = 3.3
CPU_LOOSE_TPOT_FACTOR = 6.6
TOOL_CALLS = (1, 2, 3)
"""Tool-call rounds per ToolLLM session (uniform), before the final answer."""
TOOL_RESPONSE_MEAN, TOOL_RESPONSE_P99 = 128.0, 512.0
DEFAULT_TOOL_LATENCY_S = 0.1
"""Seconds between a tool-call round's last token and the next round's arrival."""

ZeroLoadTTFT = Callable[[int], float]
"""prompt length -> seconds to the first token on an idle replica."""


class Scenario(StrEnum):
    CHATBOT = "chatbot"
    CODER = "coder"
    SUMMARIZER = "summarizer"
    MIXED = "mixed"
    TOOLLLM = "toolllm"
    REASONING = "reasoning"


class Level(StrEnum):
    TIGHT = "tight"
    LOOSE = "loose"


@dataclass(frozen=True)
class LengthStats:
    """A row half of the paper's Table 4: tokens mean, p99, std."""

    mean: float
    p99: float
    std: float


TABLE4: dict[str, LengthStats] = {
    "chatbot.prompt": LengthStats(763, 1591, 424),
    "chatbot.output": LengthStats(266, 619, 160),
    "coder.prompt": LengthStats(847, 2010, 617),
    "coder.output": LengthStats(26, 232, 47),
    "summarizer.prompt": LengthStats(1333, 1946, 444),
    "summarizer.output": LengthStats(202, 1508, 234),
    "toolllm.prompt": LengthStats(690, 2131, 356),
    "toolllm.output": LengthStats(116, 363, 66),
    "reasoning.prompt": LengthStats(127, 421, 83),
    "reasoning.thinking": LengthStats(4693, 7297, 1442),
    "reasoning.answer": LengthStats(803, 1650, 280),
}


@dataclass(frozen=True)
class LogNormalLengths:
    """Token counts from a lognormal with the given mean and p99, rounded, clipped to [1, cap]."""

    mean: float
    p99: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and math.isfinite(self.p99)) or self.mean <= 0:
            raise ValueError(f"length mean must be finite and > 0, got {self.mean!r}")
        ratio = math.log(self.p99 / self.mean) if self.p99 > 0 else -1.0
        if not 0 < ratio < Z99 * Z99 / 2:
            raise ValueError(
                f"no lognormal has mean {self.mean} and p99 {self.p99}: "
                f"need mean < p99 < {math.exp(Z99 * Z99 / 2):.1f} x mean"
            )

    @property
    def sigma(self) -> float:
        """From ln(p99/mean) = z*sigma - sigma^2/2, the root below z (the other is absurd)."""
        return Z99 - math.sqrt(Z99 * Z99 - 2 * math.log(self.p99 / self.mean))

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2

    @property
    def cap(self) -> int:
        """Largest length ever produced: the fit's 99.9th percentile, rounded up."""
        z = NormalDist().inv_cdf(CAP_QUANTILE)
        return max(1, math.ceil(math.exp(self.mu + z * self.sigma)))

    def scaled(self, factor: float) -> LogNormalLengths:
        return LogNormalLengths(self.mean * factor, self.p99 * factor)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(self.mu, self.sigma, size=n)
        return np.clip(np.rint(raw), 1, self.cap).astype(np.int64)


def table4_lengths(key: str, length_scale: float = 1.0) -> LogNormalLengths:
    """The fitted distribution for a Table 4 entry such as 'coder.output'."""
    if key not in TABLE4:
        raise ValueError(f"unknown Table 4 entry {key!r}; known: {sorted(TABLE4)}")
    stats = TABLE4[key]
    return LogNormalLengths(stats.mean, stats.p99).scaled(length_scale)


@dataclass(frozen=True)
class SLOTargets:
    """The two SLO levels: TTFT as a slowdown over zero-load TTFT, TPOT in milliseconds."""

    tight_ttft_slowdown: float = 3.0
    loose_ttft_slowdown: float = 5.0
    tight_tpot_ms: float = 50.0
    loose_tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        for name in (
            "tight_ttft_slowdown",
            "loose_ttft_slowdown",
            "tight_tpot_ms",
            "loose_tpot_ms",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        if self.tight_ttft_slowdown > self.loose_ttft_slowdown:
            raise ValueError(
                f"tight_ttft_slowdown={self.tight_ttft_slowdown} exceeds "
                f"loose_ttft_slowdown={self.loose_ttft_slowdown}"
            )
        if self.tight_tpot_ms > self.loose_tpot_ms:
            raise ValueError(
                f"tight_tpot_ms={self.tight_tpot_ms} exceeds loose_tpot_ms={self.loose_tpot_ms}"
            )

    @classmethod
    def for_decode_step(
        cls,
        decode_step_s: float,
        tight_factor: float = CPU_TIGHT_TPOT_FACTOR,
        loose_factor: float = CPU_LOOSE_TPOT_FACTOR,
    ) -> SLOTargets:
        """TPOT levels as multiples of a profiled zero-load decode step (CPU demo pair)."""
        if not math.isfinite(decode_step_s) or decode_step_s <= 0:
            raise ValueError(f"decode_step_s must be finite and > 0, got {decode_step_s!r}")
        return cls(
            tight_tpot_ms=tight_factor * decode_step_s * 1e3,
            loose_tpot_ms=loose_factor * decode_step_s * 1e3,
        )

    def ttft_ms(self, level: Level, zero_load_s: float) -> float:
        slowdown = self.tight_ttft_slowdown if level is Level.TIGHT else self.loose_ttft_slowdown
        return slowdown * zero_load_s * 1e3

    def tpot_ms(self, level: Level) -> float:
        return self.tight_tpot_ms if level is Level.TIGHT else self.loose_tpot_ms


def zero_load_ttft_from(model: PerfModel) -> ZeroLoadTTFT:
    """Zero-load TTFT from a perf model: the whole prompt as one prefill step on an idle replica."""

    def ttft(prompt_len: int) -> float:
        return model.predict(BatchShape(new_tokens=(prompt_len,), context=(0,), tp=model.tp))

    return ttft


def zero_load_decode_step_s(model: PerfModel, context: int) -> float:
    """One decode step of a lone request with `context` cached tokens (for CPU TPOT levels)."""
    return model.predict(BatchShape(new_tokens=(1,), context=(context,), tp=model.tp))


@dataclass(frozen=True)
class WorkloadRequest:
    """A request to issue, with the client-side truth the scheduler must not see."""

    request_id: str
    scenario: str
    """The application (for Mixed: the one this request came from)."""
    slo_class: str
    """'<ttft level>/<tpot level(s)>', e.g. 'loose/tight'; metrics group by it."""
    arrival_s: float
    """Seconds from the run's start (with `follows`: the session's start, a lower bound)."""
    prompt_len: int
    output_len: int
    """True output length: when the request ends (client side only)."""
    max_tokens: int
    """What the request asks for and the planner plans with (>= output_len)."""
    slo: SLO
    zero_load_ttft_s: float
    """The prompt's TTFT on an idle replica (the paper reports TTFT as a slowdown over it)."""
    follows: str | None = None
    """ToolLLM: the round this one continues; it is issued only after that round finishes."""
    delay_s: float = 0.0
    """With `follows`: seconds between that round's last token and this one's arrival."""
    shared_prefix: str | None = None
    """Requests naming the same shared prefix start with the same `prefix_len` tokens (a
    class's system prompt): a live run sends them the same text."""
    prefix_len: int = 0
    emits: tuple[tuple[int, int], ...] = ()
    """(output position, token id) the model outputs there: the token that ends an SLO stage
    whose end the planner learns only when it comes (reasoning: the end of thinking). One at
    or past output_len never comes: the stage outlasts the output."""

    def __post_init__(self) -> None:
        if any(position < 0 for position, _ in self.emits):
            raise ValueError(f"{self.request_id}: emits {self.emits} has a negative position")
        if not 1 <= self.output_len <= self.max_tokens:
            raise ValueError(
                f"{self.request_id}: output_len={self.output_len} must be in [1, max_tokens="
                f"{self.max_tokens}]"
            )
        if self.follows is None and self.delay_s != 0.0:
            raise ValueError(f"{self.request_id}: delay_s applies only to follow-up rounds")
        if self.prompt_len < 1:
            raise ValueError(f"{self.request_id}: prompt_len must be >= 1, got {self.prompt_len}")
        if (self.shared_prefix is None) != (self.prefix_len == 0) or not (
            0 <= self.prefix_len < self.prompt_len
        ):
            raise ValueError(
                f"{self.request_id}: a shared prefix needs 1 <= prefix_len < prompt_len "
                f"({self.prompt_len}), got {self.shared_prefix!r} of {self.prefix_len}"
            )

    @property
    def judged_slo(self) -> SLO:
        """The SLO as it turns out, its stages ended where the model ends them: what the
        request is judged by, and what a live client sends (its model does not think)."""
        return self.slo.after_tokens(self.emits)

    def to_request(
        self, prompt_token_ids: Sequence[int], arrival_time: float | None = None
    ) -> Request:
        """The Request the system sees: max_tokens, never output_len (see the module notes)."""
        if len(prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"{self.request_id}: prompt has {len(prompt_token_ids)} tokens, "
                f"the workload asks for {self.prompt_len}"
            )
        if arrival_time is None:
            if self.follows is not None:
                raise ValueError(
                    f"{self.request_id} follows {self.follows}: pass its actual arrival_time"
                )
            arrival_time = self.arrival_s
        return Request(
            request_id=self.request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
            slo=self.slo,
            tier=Tier.SLO,
            arrival_time=arrival_time,
        )


@dataclass(frozen=True)
class _Simple:
    """A one-request-per-arrival scenario: Table 1's levels and Table 3's arrival trace."""

    ttft: Level
    tpot: Level
    trace_file: str


SIMPLE: dict[Scenario, _Simple] = {
    Scenario.CHATBOT: _Simple(Level.LOOSE, Level.LOOSE, AZURE_CONV_FILE),
    Scenario.CODER: _Simple(Level.LOOSE, Level.TIGHT, AZURE_CODE_FILE),
    Scenario.SUMMARIZER: _Simple(Level.TIGHT, Level.LOOSE, AZURE_CONV_FILE),
}
TRACE_FILES: dict[Scenario, str] = {
    **{s: spec.trace_file for s, spec in SIMPLE.items()},
    Scenario.MIXED: AZURE_CONV_FILE,
    Scenario.TOOLLLM: AZURE_CODE_FILE,
    Scenario.REASONING: AZURE_CONV_FILE,
}
"""Each scenario's arrival trace (paper Table 3; Mixed is ours: its majority is conversational)."""
TRACE_LENGTH_SCENARIOS = (Scenario.CHATBOT, Scenario.CODER)
"""Scenarios whose service the Azure traces logged, so their lengths may come from the trace."""


class CustomWorkload(Protocol):
    """A workload of the user's own (loadgen.mixes.Mix), wherever a Scenario may go."""

    @property
    def value(self) -> str:
        """Its label, as a Scenario's value."""
        ...

    @property
    def trace_file(self) -> str:
        """The trace its trace arrivals replay: an Azure file (a TRACE_FILES value) or the
        absolute path of a CSV of the user's own."""
        ...

    def generate(
        self, arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
    ) -> list[WorkloadRequest]: ...

    def to_dict(self) -> dict[str, Any]:
        """Its definition, for the results it produced."""
        ...


Workload = Scenario | CustomWorkload


def trace_file(workload: Workload) -> str:
    """The trace file a workload's trace arrivals replay."""
    return TRACE_FILES[workload] if isinstance(workload, Scenario) else workload.trace_file


@dataclass(frozen=True)
class WorkloadConfig:
    """How to turn arrivals into requests."""

    zero_load_ttft_s: ZeroLoadTTFT
    targets: SLOTargets = SLOTargets()
    length_scale: float = 1.0
    """Multiplies every Table 4 length (e.g. 0.1 for the CPU demo pair)."""
    tool_latency_s: float = DEFAULT_TOOL_LATENCY_S
    max_model_len: int | None = None
    """When set, refuse requests whose prompt + max_tokens do not fit the model."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.length_scale) or self.length_scale <= 0:
            raise ValueError(f"length_scale must be finite and > 0, got {self.length_scale!r}")
        if not math.isfinite(self.tool_latency_s) or self.tool_latency_s < 0:
            raise ValueError(f"tool_latency_s must be finite and >= 0, got {self.tool_latency_s!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def lengths(self, key: str) -> LogNormalLengths:
        return table4_lengths(key, self.length_scale)

    def zero_load(self, prompt_len: int) -> float:
        value = self.zero_load_ttft_s(prompt_len)
        if not isinstance(value, float | int) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"zero_load_ttft_s({prompt_len}) must be finite and > 0, got {value!r}"
            )
        return float(value)

    def check_fits(self, req: WorkloadRequest) -> WorkloadRequest:
        if self.max_model_len is not None and req.prompt_len + req.max_tokens > self.max_model_len:
            raise ValueError(
                f"{req.request_id}: prompt {req.prompt_len} + max_tokens {req.max_tokens} exceeds "
                f"max_model_len={self.max_model_len}; lower length_scale"
            )
        return req


def _simple(
    scenario: Scenario,
    arrivals: Sequence[float],
    config: WorkloadConfig,
    rng: np.random.Generator,
    trace_rows: Sequence[TraceRow] | None,
    ids: Sequence[int],
) -> list[WorkloadRequest]:
    spec = SIMPLE[scenario]
    prompt = config.lengths(f"{scenario.value}.prompt")
    output = config.lengths(f"{scenario.value}.output")
    if trace_rows is None:
        prompts = prompt.sample(rng, len(arrivals))
        outputs = output.sample(rng, len(arrivals))
    else:
        scale = config.length_scale
        logged_p = np.array([r.context_tokens for r in trace_rows], dtype=float) * scale
        logged_o = np.array([r.generated_tokens for r in trace_rows], dtype=float) * scale
        prompts = np.clip(np.rint(logged_p), 1, prompt.cap).astype(np.int64)
        outputs = np.clip(np.rint(logged_o), 1, output.cap).astype(np.int64)
    out = []
    for i, arrival, p, o in zip(ids, arrivals, prompts, outputs, strict=True):
        zero = config.zero_load(int(p))
        slo = SLO(config.targets.ttft_ms(spec.ttft, zero), config.targets.tpot_ms(spec.tpot))
        req = WorkloadRequest(
            request_id=f"{scenario.value}-{i:06d}",
            scenario=scenario.value,
            slo_class=f"{spec.ttft.value}/{spec.tpot.value}",
            arrival_s=float(arrival),
            prompt_len=int(p),
            output_len=int(o),
            max_tokens=output.cap,
            slo=slo,
            zero_load_ttft_s=zero,
        )
        out.append(config.check_fits(req))
    return out


def _mixed(
    arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
) -> list[WorkloadRequest]:
    parts = list(SIMPLE)
    pick = rng.integers(len(parts), size=len(arrivals))
    out: list[WorkloadRequest] = []
    for k, scenario in enumerate(parts):
        ids = [int(i) for i in np.flatnonzero(pick == k)]
        chosen = [arrivals[i] for i in ids]
        out += _simple(scenario, chosen, config, rng, None, ids)
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def _reasoning(
    arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
) -> list[WorkloadRequest]:
    prompt = config.lengths("reasoning.prompt")
    thinking = config.lengths("reasoning.thinking")
    answer = config.lengths("reasoning.answer")
    n = len(arrivals)
    prompts, thinks, answers = prompt.sample(rng, n), thinking.sample(rng, n), answer.sample(rng, n)
    targets = config.targets
    out = []
    for i in range(n):
        zero = config.zero_load(int(prompts[i]))
        slo, emits = learned_stages(
            targets.ttft_ms(Level.TIGHT, zero),
            [(Stage(targets.tight_tpot_ms, name="thinking"), int(thinks[i]))],
            Stage(targets.loose_tpot_ms, name="answer"),
        )
        req = WorkloadRequest(
            request_id=f"reasoning-{i:06d}",
            scenario=Scenario.REASONING.value,
            slo_class="tight/tight+loose",
            arrival_s=float(arrivals[i]),
            prompt_len=int(prompts[i]),
            output_len=int(thinks[i] + answers[i]),
            max_tokens=thinking.cap + answer.cap,
            slo=slo,
            zero_load_ttft_s=zero,
            emits=emits,
        )
        out.append(config.check_fits(req))
    return out


def learned_stages(
    ttft_ms: float, stages: Sequence[tuple[Stage, int]], answer: Stage
) -> tuple[SLO, tuple[tuple[int, int], ...]]:
    """An SLO of `stages` (each with its true length), then `answer`, where every stage ends
    on `STAGE_END_TOKEN`, and where the model outputs it: the planner learns each boundary
    when the model reaches it."""
    emits = tuple((end - 1, STAGE_END_TOKEN) for end in itertools.accumulate(n for _, n in stages))
    learned = [
        replace(stage, num_tokens=None, end_token_ids=(STAGE_END_TOKEN,)) for stage, _ in stages
    ]
    return SLO(ttft_ms, learned[0].tpot_ms, (*learned, answer)), emits


def _toolllm(
    arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
) -> list[WorkloadRequest]:
    prompt = config.lengths("toolllm.prompt")
    output = config.lengths("toolllm.output")
    response = LogNormalLengths(TOOL_RESPONSE_MEAN, TOOL_RESPONSE_P99).scaled(config.length_scale)
    targets = config.targets

    def slo_of(final: bool, zero_load_s: float) -> tuple[str, SLO]:
        tpot = Level.LOOSE if final else Level.TIGHT
        slo = SLO(targets.ttft_ms(Level.TIGHT, zero_load_s), targets.tpot_ms(tpot))
        return f"tight/{tpot.value}", slo

    out = []
    for i, arrival in enumerate(arrivals):
        rounds = 1 + int(rng.choice(TOOL_CALLS))
        out += tool_session(
            f"toolllm-{i:06d}",
            Scenario.TOOLLLM.value,
            arrival,
            int(prompt.sample(rng, 1)[0]),
            rounds,
            slo_of=slo_of,
            draw_output=lambda: int(output.sample(rng, 1)[0]),
            draw_response=lambda: int(response.sample(rng, 1)[0]),
            max_tokens=output.cap,
            latency_s=config.tool_latency_s,
            config=config,
        )
    return out


def tool_session(
    session_id: str,
    scenario: str,
    arrival_s: float,
    prompt_len: int,
    rounds: int,
    *,
    slo_of: Callable[[bool, float], tuple[str, SLO]],
    draw_output: Callable[[], int],
    draw_response: Callable[[], int],
    max_tokens: int,
    latency_s: float,
    config: WorkloadConfig,
) -> list[WorkloadRequest]:
    """One session of `rounds` requests (tool calls, then the answer): each prompt is the last
    one plus its output and a tool response, each round is issued `latency_s` after the one it
    follows. `slo_of(final, zero-load TTFT)` gives a round's SLO class and SLO; a round draws
    its output, then its tool response, so a seed gives the same session (toolllm, and mix
    classes with tools)."""
    context = prompt_len
    out: list[WorkloadRequest] = []
    for k in range(rounds):
        zero = config.zero_load(context)
        slo_class, slo = slo_of(k == rounds - 1, zero)
        req = WorkloadRequest(
            request_id=f"{session_id}.r{k}",
            scenario=scenario,
            slo_class=slo_class,
            arrival_s=float(arrival_s),
            prompt_len=context,
            output_len=min(draw_output(), max_tokens),
            max_tokens=max_tokens,
            slo=slo,
            zero_load_ttft_s=zero,
            follows=out[-1].request_id if out else None,
            delay_s=latency_s if out else 0.0,
        )
        out.append(config.check_fits(req))
        context += req.output_len + draw_response()
    return out


def grow_rounds(
    workload: Sequence[WorkloadRequest], at_least: int, config: WorkloadConfig
) -> list[WorkloadRequest]:
    """The workload with every follow-up round's prompt at least `at_least` tokens longer than
    the prompt of the round it follows (the rounds after it longer by as much): a chat's next
    round adds at least the role markers of two messages. Its SLO is the planned length's."""
    out: list[WorkloadRequest] = []
    by_id: dict[str, WorkloadRequest] = {}
    added: dict[str, int] = {}
    for r in workload:
        if r.follows is not None:
            length = max(r.prompt_len + added[r.follows], by_id[r.follows].prompt_len + at_least)
            added[r.request_id] = length - r.prompt_len
            if length != r.prompt_len:
                r = config.check_fits(replace(r, prompt_len=length))
        added.setdefault(r.request_id, 0)
        by_id[r.request_id] = r
        out.append(r)
    return out


P = TypeVar("P")
"""A prompt, as a source makes them (text and tokens live, token ids in simulation)."""


def shared_prompts(
    workload: Sequence[WorkloadRequest],
    new: Callable[[int], P],
    after: Callable[[P, int], P],
    history: Callable[[WorkloadRequest, P], P] = lambda _before, prompt: prompt,
) -> dict[str, P]:
    """One prompt per request, sharing what real traffic shares: requests of a class with a
    system prompt start with the same `new(prefix_len)`, and a follow-up round starts with
    the history of the round it follows (`history(that round, its prompt)`); `after(head, n)`
    continues a head to n tokens. Made in workload order, so a seeded source gives the same
    prompts every time."""
    by_id = {r.request_id: r for r in workload}
    prefixes: dict[tuple[str, int], P] = {}
    prompts: dict[str, P] = {}

    def prompt_of(r: WorkloadRequest) -> P:
        if r.request_id in prompts:
            return prompts[r.request_id]
        if r.follows is not None:
            before = by_id[r.follows]
            prompt = after(history(before, prompt_of(before)), r.prompt_len)
        elif r.shared_prefix is not None:
            key = (r.shared_prefix, r.prefix_len)
            if key not in prefixes:
                prefixes[key] = new(r.prefix_len)
            prompt = after(prefixes[key], r.prompt_len)
        else:
            prompt = new(r.prompt_len)
        prompts[r.request_id] = prompt
        return prompt

    for r in workload:
        prompt_of(r)
    return prompts


def generate_workload(
    scenario: Workload | str,
    arrivals: Sequence[float] | np.ndarray,
    config: WorkloadConfig,
    seed: int,
    trace_rows: Sequence[TraceRow] | None = None,
) -> list[WorkloadRequest]:
    """Requests for a scenario, one per arrival (ToolLLM: one session of rounds per arrival).

    Deterministic for a seed. `trace_rows` (ChatBot, Coder only) pairs arrival i with trace row
    i's logged lengths, e.g. the rows loadgen.arrivals.trace_arrivals returned.
    """
    if isinstance(scenario, str):
        scenario = Scenario(scenario)
    times = [float(t) for t in arrivals]
    if not times:
        raise ValueError("arrivals must not be empty")
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError("arrival times must be finite and >= 0")
    if any(b < a for a, b in itertools.pairwise(times)):
        raise ValueError("arrival times must be sorted")
    if trace_rows is not None:
        if not isinstance(scenario, Scenario) or scenario not in TRACE_LENGTH_SCENARIOS:
            raise ValueError(
                f"workload {scenario.value!r} cannot take trace lengths; only "
                f"{[s.value for s in TRACE_LENGTH_SCENARIOS]} match the traced services"
            )
        if len(trace_rows) != len(times):
            raise ValueError(f"{len(trace_rows)} trace rows for {len(times)} arrivals")
    rng = np.random.default_rng(seed)
    if not isinstance(scenario, Scenario):
        return scenario.generate(times, config, rng)
    if scenario is Scenario.MIXED:
        return _mixed(times, config, rng)
    if scenario is Scenario.REASONING:
        return _reasoning(times, config, rng)
    if scenario is Scenario.TOOLLLM:
        return _toolllm(times, config, rng)
    return _simple(scenario, times, config, rng, trace_rows, range(len(times)))
