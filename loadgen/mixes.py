"""Your own traffic mix as a workload: application classes with their shares, lengths and SLOs.

The paper's scenarios fix the applications; a service that runs its own set (a chatbot beside a
coding assistant and an agent, each with its own TTFT and TPOT) describes it in a YAML or JSON
file and passes the file wherever a scenario name goes (`slos-serve simulate --scenario`,
`slos-serve loadgen --scenario`, `slos-serve compare --scenario`):

    name: my-services          # label in tables and plots (default: the file's stem)
    trace: conversation        # --arrivals trace replays conversation (steady), code (bursty)
                               # or a CSV of your own in their format (relative to this file)
    classes:
      - name: chat
        share: 0.4             # of the arrivals; shares are normalized over the classes
        prompt: {mean: 763, p99: 1591}
        output: {mean: 266, p99: 619}
        ttft: loose            # tight | loose: 3x | 5x the prompt's zero-load TTFT
        tpot: loose            # tight | loose: the run's two TPOT levels
      - name: copilot
        share: 0.3
        prompt: {mean: 847, p99: 2010}
        output: 32             # a fixed length
        max_tokens: 64         # what the request asks for (default: the output's largest length)
        ttft_ms: 400           # absolute targets instead of levels
        tpot_ms: 40
      - name: reasoner         # stages before the answer, each with its own length and TPOT
        share: 0.1
        prompt: {mean: 127, p99: 421}
        stages:
          - {name: thinking, tokens: {mean: 4693, p99: 7297}, tpot: tight}
        output: {mean: 803, p99: 1650}    # the answer, after the stages
        ttft: tight
        tpot: loose                       # the answer's
      - name: support          # every request starts with the same 256 tokens (a system
        share: 0.1             # prompt): what a server's prefix cache keeps
        prompt: {mean: 900, p99: 2000}   # the system prompt counted in
        output: {mean: 200, p99: 500}
        system_prompt: 256
        ttft: loose
        tpot: loose
      - name: agent            # a session: tool-call rounds, then the answer, each a request
        share: 0.2
        prompt: {mean: 690, p99: 2131}
        output: {mean: 116, p99: 363}     # every round's
        ttft: tight
        tpot: loose                       # the answer's
        tools:
          calls: [1, 3]                   # rounds before the answer, uniform (or one count)
          tpot: tight                     # the tool-call rounds' (default: the class's)
          response: {mean: 128, p99: 512} # tokens a tool adds to the next round's prompt
          latency_ms: 100                 # a round's last token to the next round's arrival

Lengths are a lognormal fitted to mean and p99 (as the scenarios' Table 4 lengths) or a fixed
count; `--length-scale` shrinks them and `max_tokens` alike. Level SLOs follow the run's SLO
targets (GPU levels, or the CPU demo pair's scaled ones), so one file serves both; absolute ones
are sent as written. With `stages` a request's SLO has a stage per entry and then the
answer's; as in the reasoning scenario, each stage ends on a token the simulated model outputs
after the stage's sampled length, so the planner learns the boundary only when it comes (a
live run tells the server where it lies: the demo model does not think). With `tools` an
arrival is a session, as in the toolllm scenario: each round is a request with the class's
TTFT whose prompt is the previous one plus its output and a tool response, sent
`latency_ms` after that round's last token (the rate counts sessions). Each
request's class name is its scenario and SLO class in the records and the per-class report.
With `system_prompt: N` every request of the class (every round of a session) starts with the
same N tokens, scaled by `--length-scale` like the lengths (a prompt drawn shorter is
lengthened to N + 1): live runs send the same text, so a server's prefix cache computes it
once. The simulator does not model prefix caches, so it runs such a class as any other.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadgen.traces import AZURE_CODE_FILE, AZURE_CONV_FILE, read_trace
from loadgen.workloads import (
    TOOL_RESPONSE_MEAN,
    TOOL_RESPONSE_P99,
    Level,
    LogNormalLengths,
    Scenario,
    WorkloadConfig,
    WorkloadRequest,
    learned_stages,
    tool_session,
)
from replica.request import SLO, Stage

MIX_TRACES = {"conversation": AZURE_CONV_FILE, "code": AZURE_CODE_FILE}
"""`trace` names: which Azure trace --arrivals trace replays (any other value is a CSV path)."""
MIX_SUFFIXES = (".yaml", ".yml", ".json")
_STAGE_KEYS = {"name", "tokens", "tpot", "tpot_ms"}
_TOOLS_KEYS = {"calls", "response", "latency_ms", "tpot", "tpot_ms"}
_CLASS_KEYS = {
    "name",
    "share",
    "prompt",
    "output",
    "max_tokens",
    "stages",
    "tools",
    "ttft",
    "ttft_ms",
    "tpot",
    "tpot_ms",
    "system_prompt",
}
_MIX_KEYS = {"name", "trace", "classes"}


@dataclass(frozen=True)
class Lengths:
    """Token counts of a class: a fixed count, or a lognormal by mean and p99."""

    mean: float
    p99: float | None = None
    """None: every request has `mean` tokens."""

    def fitted(self, scale: float) -> LogNormalLengths | int:
        if self.p99 is None:
            return max(1, round(self.mean * scale))
        return LogNormalLengths(self.mean, self.p99).scaled(scale)

    def to_dict(self) -> int | dict[str, float]:
        return round(self.mean) if self.p99 is None else {"mean": self.mean, "p99": self.p99}


@dataclass(frozen=True)
class MixStage:
    """A stage before a class's answer: its length and TPOT."""

    name: str
    tokens: Lengths
    tpot: Level | float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tokens": self.tokens.to_dict(),
            **_target_dict("tpot", self.tpot),
        }


@dataclass(frozen=True)
class MixTools:
    """A class's sessions: tool-call rounds before the answer."""

    calls: tuple[int, int]
    """Fewest and most tool-call rounds (uniform)."""
    response: Lengths
    latency_ms: float | None
    """None: the run's WorkloadConfig.tool_latency_s."""
    tpot: Level | float | None
    """The tool-call rounds' TPOT; None: the class's."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"calls": list(self.calls), "response": self.response.to_dict()}
        if self.latency_ms is not None:
            out["latency_ms"] = self.latency_ms
        return out | ({} if self.tpot is None else _target_dict("tpot", self.tpot))


@dataclass(frozen=True)
class MixClass:
    """One application: its share of the arrivals, lengths and SLO."""

    name: str
    share: float
    prompt: Lengths
    output: Lengths
    ttft: Level | float
    """A level (a slowdown over the prompt's zero-load TTFT) or milliseconds."""
    tpot: Level | float
    """A level (the run's TPOT targets) or milliseconds; with stages, the answer's."""
    max_tokens: int | None = None
    stages: tuple[MixStage, ...] = ()
    tools: MixTools | None = None
    system_prompt: int = 0
    """Tokens every request of the class starts with (0: none)."""

    def ttft_ms(self, config: WorkloadConfig, zero_load_s: float) -> float:
        if isinstance(self.ttft, Level):
            return config.targets.ttft_ms(self.ttft, zero_load_s)
        return self.ttft

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "share": self.share,
            "prompt": self.prompt.to_dict(),
            "output": self.output.to_dict(),
            **_target_dict("ttft", self.ttft),
            **_target_dict("tpot", self.tpot),
        }
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.stages:
            out["stages"] = [stage.to_dict() for stage in self.stages]
        if self.tools is not None:
            out["tools"] = self.tools.to_dict()
        if self.system_prompt:
            out["system_prompt"] = self.system_prompt
        return out


@dataclass(frozen=True)
class Mix:
    """A traffic mix: where a scenario name goes, a file of application classes."""

    name: str
    classes: tuple[MixClass, ...]
    trace: str = "conversation"
    """A MIX_TRACES name, or the absolute path of a trace CSV of your own."""

    @property
    def value(self) -> str:
        """The label tables, plots and JSON keys use (a Scenario's value is its name too)."""
        return self.name

    @property
    def trace_file(self) -> str:
        return MIX_TRACES.get(self.trace, self.trace)

    def generate(
        self, arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
    ) -> list[WorkloadRequest]:
        return generate_mix(self, arrivals, config, rng)

    def to_dict(self) -> dict[str, Any]:
        """The file's form (`mix_from_dict` reads it back): results carry the mix they ran."""
        return {
            "name": self.name,
            "trace": self.trace,
            "classes": [c.to_dict() for c in self.classes],
        }

    @classmethod
    def load(cls, path: str | Path) -> Mix:
        path = Path(path)
        if path.suffix not in MIX_SUFFIXES:
            raise ValueError(f"{path}: a mix file ends in one of {', '.join(MIX_SUFFIXES)}")
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read mix file {path}: {exc}") from None
        try:
            return mix_from_dict(data, default_name=path.stem, base=path.resolve().parent)
        except ValueError as exc:
            raise ValueError(f"mix file {path}: {exc}") from None


@cache
def parse_workload(text: str) -> Scenario | Mix:
    """A built-in scenario's name, or the path of a mix file (see the module notes). A file is
    read once per process: every config of a compare and every point of a capacity search
    sends the same mix, even if the file is edited while they run."""
    if text in {s.value for s in Scenario}:
        return Scenario(text)
    if Path(text).suffix in MIX_SUFFIXES:
        return Mix.load(text)
    raise ValueError(
        f"{text!r} is neither a scenario ({', '.join(s.value for s in Scenario)}) nor a mix "
        f"file ({', '.join(MIX_SUFFIXES)})"
    )


def mix_from_dict(data: Any, default_name: str, base: Path | None = None) -> Mix:
    """A Mix from its parsed file; every error names the field (and class) at fault. A trace
    path is taken relative to `base` (the file's directory; default: the working one)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"expected a mapping with 'classes', got {type(data).__name__}")
    _no_unknown(data, _MIX_KEYS, "the mix")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name or "," in name:
        raise ValueError(f"name must be a non-empty string without commas, got {name!r}")
    trace = _trace(data.get("trace", "conversation"), base or Path.cwd())
    raw = data.get("classes")
    if not isinstance(raw, list) or not raw:
        raise ValueError("classes must be a non-empty list")
    classes = tuple(_mix_class(item, i) for i, item in enumerate(raw))
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"class names must be distinct, got {names}")
    return Mix(name, classes, trace)


def _trace(value: Any, base: Path) -> str:
    """A MIX_TRACES name as it is; else a trace CSV's absolute path, read now so a bad file
    is named before anything runs."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"trace must be one of {sorted(MIX_TRACES)} or a CSV path, got {value!r}")
    if value in MIX_TRACES:
        return value
    path = (base / value).resolve()
    try:
        read_trace(path)
    except ValueError as exc:
        raise ValueError(
            f"trace {value!r} must be one of {sorted(MIX_TRACES)} or a trace CSV "
            f"(TIMESTAMP, ContextTokens, GeneratedTokens): {exc}"
        ) from None
    return str(path)


def _mix_class(data: Any, index: int) -> MixClass:
    where = f"classes[{index}]"
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name must be a non-empty string, got {name!r}")
    where = f"class {name!r}"
    _no_unknown(data, _CLASS_KEYS, where)
    share = _number(data.get("share"), f"{where}: share")
    prompt = _lengths(data.get("prompt"), f"{where}: prompt")
    output = _lengths(data.get("output"), f"{where}: output")
    max_tokens = data.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    stages = data.get("stages", [])
    if not isinstance(stages, list):
        raise ValueError(f"{where}: stages must be a list, got {stages!r}")
    tools = data.get("tools")
    if tools is not None and stages:
        raise ValueError(f"{where}: stages and tools do not combine; give one of them")
    system = data.get("system_prompt", 0)
    if isinstance(system, bool) or not isinstance(system, int) or system < 0:
        raise ValueError(f"{where}: system_prompt must be an integer >= 0, got {system!r}")
    return MixClass(
        name=name,
        share=share,
        prompt=prompt,
        output=output,
        ttft=_target(data, "ttft", where),
        tpot=_target(data, "tpot", where),
        max_tokens=max_tokens,
        stages=tuple(_stage(item, f"{where}: stages[{i}]") for i, item in enumerate(stages)),
        tools=None if tools is None else _tools(tools, f"{where}: tools"),
        system_prompt=system,
    )


def _tools(data: Any, where: str) -> MixTools:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    _no_unknown(data, _TOOLS_KEYS, where)
    calls = data.get("calls")
    span = [calls, calls] if isinstance(calls, int) else calls
    if (
        not isinstance(span, list)
        or len(span) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in span)
        or not 1 <= span[0] <= span[1]
    ):
        raise ValueError(f"{where}.calls must be a count >= 1 or [fewest, most], got {calls!r}")
    response = data.get("response", {"mean": TOOL_RESPONSE_MEAN, "p99": TOOL_RESPONSE_P99})
    latency = data.get("latency_ms")
    has_tpot = "tpot" in data or "tpot_ms" in data
    return MixTools(
        calls=(span[0], span[1]),
        response=_lengths(response, f"{where}.response"),
        latency_ms=None if latency is None else _number(latency, f"{where}.latency_ms"),
        tpot=_target(data, "tpot", where) if has_tpot else None,
    )


def _stage(data: Any, where: str) -> MixStage:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    _no_unknown(data, _STAGE_KEYS, where)
    name = data.get("name", "")
    if not isinstance(name, str):
        raise ValueError(f"{where}.name must be a string, got {name!r}")
    tokens = _lengths(data.get("tokens"), f"{where}.tokens")
    return MixStage(name, tokens, _target(data, "tpot", where))


def _no_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        hint = ""
        if isinstance(value, str) and "e" in value.lower():
            hint = " (YAML 1.1 reads an exponent without a dot as text: write 1.0e-9, not 1e-9)"
        raise ValueError(f"{what} must be a finite number, got {value!r}{hint}")
    if value <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r}")
    return float(value)


def _lengths(value: Any, what: str) -> Lengths:
    if isinstance(value, Mapping):
        if set(value) != {"mean", "p99"}:
            raise ValueError(f"{what} takes {{mean, p99}} or a fixed count, got {dict(value)!r}")
        lengths = Lengths(
            _number(value["mean"], f"{what}.mean"), _number(value["p99"], f"{what}.p99")
        )
        try:
            lengths.fitted(1.0)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        return lengths
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be {{mean, p99}} or a fixed count >= 1, got {value!r}")
    return Lengths(float(value))


def _target_dict(key: str, target: Level | float) -> dict[str, str | float]:
    return {key: target.value} if isinstance(target, Level) else {f"{key}_ms": target}


def _target(data: Mapping[str, Any], key: str, where: str) -> Level | float:
    """`ttft`/`tpot` as a level, or `ttft_ms`/`tpot_ms`: exactly one of the two."""
    level, ms = data.get(key), data.get(f"{key}_ms")
    if (level is None) == (ms is None):
        raise ValueError(f"{where}: give exactly one of {key} (tight | loose) and {key}_ms")
    if ms is not None:
        return _number(ms, f"{where}: {key}_ms")
    if level not in {lv.value for lv in Level}:
        raise ValueError(f"{where}: {key} must be tight or loose, got {level!r}")
    return Level(level)


def generate_mix(
    mix: Mix, arrivals: Sequence[float], config: WorkloadConfig, rng: np.random.Generator
) -> list[WorkloadRequest]:
    """One request per arrival, its class drawn by share (deterministic for the generator); a
    request that cannot be made (its SLO out of range, its length past max_model_len) is
    named with its class."""
    shares = np.array([c.share for c in mix.classes])
    pick = rng.choice(len(mix.classes), size=len(arrivals), p=shares / shares.sum())
    out: list[WorkloadRequest] = []
    for k, cls in enumerate(mix.classes):
        ids = [int(i) for i in np.flatnonzero(pick == k)]
        try:
            out += _class_requests(cls, ids, arrivals, config, rng)
        except ValueError as exc:
            raise ValueError(f"class {cls.name!r}: {exc}") from None
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def _class_requests(
    cls: MixClass,
    ids: list[int],
    arrivals: Sequence[float],
    config: WorkloadConfig,
    rng: np.random.Generator,
) -> list[WorkloadRequest]:
    """The requests of the arrivals `ids`, all of class `cls`."""
    scale = config.length_scale
    system = _system_prompt(cls, scale)
    prompts = [max(p, system + 1) for p in _sample(cls.prompt, scale, rng, len(ids))]
    if cls.tools is not None:
        out: list[WorkloadRequest] = []
        for i, p in zip(ids, prompts, strict=True):
            rounds = _session(cls, cls.tools, f"{cls.name}-{i:06d}", arrivals[i], p, config, rng)
            out += [_with_system_prompt(r, cls.name, system) for r in rounds]
        return out
    staged = [_sample(stage.tokens, scale, rng, len(ids)) for stage in cls.stages]
    outputs = _sample(cls.output, scale, rng, len(ids))
    max_tokens = _max_tokens(cls, scale)
    requests = []
    for n, (i, p, o) in enumerate(zip(ids, prompts, outputs, strict=True)):
        zero = config.zero_load(p)
        lengths = [tokens[n] for tokens in staged]
        slo, emits = _slo(cls, config, zero, lengths)
        req = WorkloadRequest(
            request_id=f"{cls.name}-{i:06d}",
            scenario=cls.name,
            slo_class=cls.name,
            arrival_s=float(arrivals[i]),
            prompt_len=p,
            output_len=min(sum(lengths) + o, max_tokens),
            max_tokens=max_tokens,
            slo=slo,
            zero_load_ttft_s=zero,
            emits=emits,
        )
        requests.append(config.check_fits(_with_system_prompt(req, cls.name, system)))
    return requests


def _session(
    cls: MixClass,
    tools: MixTools,
    session_id: str,
    arrival_s: float,
    prompt_len: int,
    config: WorkloadConfig,
    rng: np.random.Generator,
) -> list[WorkloadRequest]:
    """One arrival's rounds: tool calls, then the answer (workloads.tool_session)."""
    scale = config.length_scale

    def slo_of(final: bool, zero_load_s: float) -> tuple[str, SLO]:
        tpot = cls.tpot if final or tools.tpot is None else tools.tpot
        return cls.name, SLO(cls.ttft_ms(config, zero_load_s), _tpot_ms(tpot, config))

    return tool_session(
        session_id,
        cls.name,
        arrival_s,
        prompt_len,
        1 + int(rng.integers(tools.calls[0], tools.calls[1] + 1)),
        slo_of=slo_of,
        draw_output=lambda: _sample(cls.output, scale, rng, 1)[0],
        draw_response=lambda: _sample(tools.response, scale, rng, 1)[0],
        max_tokens=_max_tokens(cls, scale),
        latency_s=config.tool_latency_s if tools.latency_ms is None else tools.latency_ms / 1e3,
        config=config,
    )


def _system_prompt(cls: MixClass, scale: float) -> int:
    """The class's system prompt in tokens, scaled (one at least, when it has one)."""
    return max(1, round(cls.system_prompt * scale)) if cls.system_prompt else 0


def _with_system_prompt(request: WorkloadRequest, name: str, tokens: int) -> WorkloadRequest:
    if not tokens:
        return request
    return dataclasses.replace(request, shared_prefix=name, prefix_len=tokens)


def _slo(
    cls: MixClass, config: WorkloadConfig, zero_load_s: float, lengths: list[int]
) -> tuple[SLO, tuple[tuple[int, int], ...]]:
    """The class's SLO; with stages, one per entry of `lengths` tokens, each ending on a token
    the model outputs there (workloads.learned_stages), then the answer's."""
    ttft = cls.ttft_ms(config, zero_load_s)
    answer = _tpot_ms(cls.tpot, config)
    if not cls.stages:
        return SLO(ttft, answer), ()
    stages = [
        (Stage(_tpot_ms(stage.tpot, config), name=stage.name), n)
        for stage, n in zip(cls.stages, lengths, strict=True)
    ]
    return learned_stages(ttft, stages, Stage(answer, name="answer"))


def _tpot_ms(target: Level | float, config: WorkloadConfig) -> float:
    return config.targets.tpot_ms(target) if isinstance(target, Level) else target


def _sample(lengths: Lengths, scale: float, rng: np.random.Generator, n: int) -> list[int]:
    fitted = lengths.fitted(scale)
    if isinstance(fitted, int):
        return [fitted] * n
    return [int(x) for x in fitted.sample(rng, n)]


def _max_tokens(cls: MixClass, scale: float) -> int:
    """What the class's requests ask for: its own max_tokens, else its longest output (every
    stage's longest, plus the answer's)."""
    if cls.max_tokens is not None:
        return max(1, round(cls.max_tokens * scale))
    return sum(
        _longest(lengths, scale) for lengths in (*(s.tokens for s in cls.stages), cls.output)
    )


def _longest(lengths: Lengths, scale: float) -> int:
    fitted = lengths.fitted(scale)
    return fitted if isinstance(fitted, int) else fitted.cap
