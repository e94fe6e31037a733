"""Batch execution time as a generalized roofline: the slowest of a few linear bottlenecks.

    T(x) = max_k  a_k . x        every a_k >= 0

x holds a step's features (FEATURES): a constant, target query tokens, requests, attention pairs
(query x key), KV-cache tokens read, attention slots of a padded backend, and the draft model's
sequential steps and drafted tokens. A term is one bottleneck (GEMMs compute-bound, weights
streamed from memory, ...). Sums of maxima are maxima of sums, so "GEMM roofline + attention
roofline + overhead" is still one max over linear terms (analytic profiles use four).
Non-negative coefficients keep the model monotone: more tokens, context or drafting never
predicts a faster step, which the planner's inverse (`max_new_tokens_within`) relies on.

The model is pure (no torch, no clock) and fast (a few microseconds per prediction), because the
planner calls it inside its dynamic program.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from replica.batch import BatchPlan, DecodeStep
from replica.compiled import reduce_frozen
from replica.perf_info import ProfileInfo, Slowdown

FORMAT = "slos-serve-perf-model/1"
PROFILE_FIELDS = ("source", "backend", "device", "model", "terms")
"""What every profile JSON holds (the rest has defaults)."""
FEATURES: tuple[str, ...] = (
    "const",
    "tokens",
    "requests",
    "attn_tokens",
    "kv_tokens",
    "padded_attn_tokens",
    "draft_steps",
    "draft_tokens",
    "draft_kv_tokens",
)
"""Feature names in coefficient order (see BatchFeatures for their meaning)."""
_CONST = FEATURES.index("const")
_TOKENS = FEATURES.index("tokens")
_ATTN = FEATURES.index("attn_tokens")
_KV = FEATURES.index("kv_tokens")
_PADDED = FEATURES.index("padded_attn_tokens")
_DRAFT_KV = FEATURES.index("draft_kv_tokens")


_INT = {int}
"""The one type of valid counts (bool, an int subclass, is not one)."""


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_draft(draft_steps: int, draft_batch: int, num_requests: int) -> None:
    _check_count("draft_steps", draft_steps)
    _check_count("draft_batch", draft_batch)
    if (draft_steps == 0) != (draft_batch == 0):
        raise ValueError(
            f"draft_steps and draft_batch must both be 0 or both > 0, "
            f"got draft_steps={draft_steps}, draft_batch={draft_batch}"
        )
    if draft_batch > num_requests:
        raise ValueError(f"draft_batch={draft_batch} exceeds num_requests={num_requests}")


@dataclass(frozen=True)
class BatchFeatures:
    """What a step costs depends on, aggregated over its requests.

    `attn_tokens` counts (query, key) pairs: a prefill chunk of n tokens on context c adds
    n*c + n*(n+1)/2, a decode c+1 (compute-bound attention). `kv_tokens` counts KV entries read
    once per request, c + n (memory-bound attention: decode reads the cache once for all its
    k+1 verify tokens). `padded_attn_tokens` counts the (query, key) slots a backend computes
    when it pads every request to the batch's longest query and longest KV (requests x max q x
    max kv); it defaults to attn_tokens, i.e. ragged attention. Our CPU path gives each prefill
    chunk its own call, so measured CPU profiles fit it a weight of 0; it stays for backends
    that do pad.
    The draft's attention is charged by `draft_kv_tokens` = draft steps x drafting requests x
    the batch's mean KV per request (the draft reads about the same context as the target)."""

    num_tokens: int
    num_requests: int
    attn_tokens: int
    kv_tokens: int
    draft_steps: int = 0
    """Sequential draft forwards (the largest speculation length in the batch)."""
    draft_batch: int = 0
    """Requests that draft."""
    padded_attn_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_tokens", "num_requests", "attn_tokens", "kv_tokens"):
            _check_count(name, getattr(self, name))
        if self.padded_attn_tokens is not None:
            _check_count("padded_attn_tokens", self.padded_attn_tokens)
        _check_draft(self.draft_steps, self.draft_batch, self.num_requests)

    def vector(self) -> tuple[float, ...]:
        """Values aligned with FEATURES."""
        padded = self.attn_tokens if self.padded_attn_tokens is None else self.padded_attn_tokens
        return _vector(
            self.num_tokens,
            self.num_requests,
            self.attn_tokens,
            self.kv_tokens,
            padded,
            self.draft_steps,
            self.draft_batch,
        )


def _least_vector(prompt_len: int, output_len: int) -> tuple[float, ...]:
    """The features of one request's prompt as one chunk plus one decode step per later
    token, on contexts prompt_len, ..., prompt_len + steps - 1, in closed form."""
    _check_count("prompt_len", prompt_len)
    _check_count("output_len", output_len)
    if prompt_len < 1 or output_len < 1:
        raise ValueError(
            f"a request needs a prompt and an output, got {prompt_len=}, {output_len=}"
        )
    steps = output_len - 1
    contexts = steps * prompt_len + steps * (steps - 1) // 2
    return _vector(
        num_tokens=prompt_len + steps,
        num_requests=1 + steps,
        attn_tokens=attention_pairs(prompt_len, 0) + contexts + steps,
        kv_tokens=prompt_len + steps + contexts,
        padded_attn_tokens=0,
        draft_steps=0,
        draft_batch=0,
    )


def _vector(
    num_tokens: int,
    num_requests: int,
    attn_tokens: int,
    kv_tokens: int,
    padded_attn_tokens: int,
    draft_steps: int,
    draft_batch: int,
) -> tuple[float, ...]:
    """The feature vector (FEATURES order) of validated counts."""
    drafted = draft_steps * draft_batch
    draft_kv = drafted * kv_tokens / num_requests if num_requests else 0.0
    return (
        1.0,
        float(num_tokens),
        float(num_requests),
        float(attn_tokens),
        float(kv_tokens),
        float(padded_attn_tokens),
        float(draft_steps),
        float(drafted),
        draft_kv,
    )


@dataclass(frozen=True)
class BatchShape:
    """One step request by request: new (query) tokens and cached context of each."""

    new_tokens: tuple[int, ...]
    """Target query tokens per request this step (prefill chunk, 1, or k+1)."""
    context: tuple[int, ...]
    """Tokens already in the KV cache per request before the step."""
    draft_steps: int = 0
    """Sequential draft forwards (max k in the batch)."""
    draft_batch: int = 0
    """Requests that draft."""
    tp: int = 1
    """Tensor-parallel degree the step runs at (must match the model's)."""

    def __post_init__(self) -> None:
        if len(self.new_tokens) != len(self.context):
            raise ValueError(
                f"new_tokens has {len(self.new_tokens)} entries but context has {len(self.context)}"
            )
        # Checked in bulk first (steps are priced by the hundred thousand); only when that
        # fails does the entry by entry check run, to name the first bad one.
        if not (
            {*map(type, self.new_tokens), *map(type, self.context)} <= _INT
            and min(self.new_tokens, default=1) >= 1
            and min(self.context, default=0) >= 0
        ):
            self._check_entries()
        _check_draft(self.draft_steps, self.draft_batch, len(self.new_tokens))
        _check_count("tp", self.tp)
        if self.tp == 0:
            raise ValueError("tp must be >= 1, got 0")

    def _check_entries(self) -> None:
        for n in self.new_tokens:
            _check_count("new_tokens entry", n)
            if n == 0:
                raise ValueError("new_tokens entries must be >= 1, got 0")
        for c in self.context:
            _check_count("context entry", c)

    @classmethod
    def of_plan(cls, plan: BatchPlan, computed: Callable[[str], int], tp: int = 1) -> BatchShape:
        """A plan as the model sees it: each entry's new tokens (a decode feeds its drafts and
        one token) over its `computed(request_id)` context (0 once preempted: it restarts)."""
        new_tokens, context, drafting = [], [], []
        for entry in plan.entries:
            if isinstance(entry, DecodeStep):
                new_tokens.append(entry.num_spec_tokens + 1)
                if entry.num_spec_tokens > 0:
                    drafting.append(entry.num_spec_tokens)
            else:
                new_tokens.append(entry.num_tokens)
            rid = entry.request_id
            context.append(0 if rid in plan.preempt else computed(rid))
        return cls(
            tuple(new_tokens),
            tuple(context),
            draft_steps=max(drafting, default=0),
            draft_batch=len(drafting),
            tp=tp,
        )

    def features(self) -> BatchFeatures:
        pairs = list(zip(self.new_tokens, self.context, strict=True))
        max_q = max(self.new_tokens, default=0)
        max_kv = max((n + c for n, c in pairs), default=0)
        return BatchFeatures(
            num_tokens=sum(self.new_tokens),
            num_requests=len(pairs),
            attn_tokens=sum(attention_pairs(n, c) for n, c in pairs),
            kv_tokens=sum(self.new_tokens) + sum(self.context),
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
            padded_attn_tokens=len(pairs) * max_q * max_kv,
        )


def attention_pairs(new_tokens: int, context: int) -> int:
    """(query, key) pairs of n causal query tokens on c cached tokens: n*c + n*(n+1)/2."""
    return new_tokens * context + new_tokens * (new_tokens + 1) // 2


@dataclass(frozen=True)
class Term:
    """One bottleneck: seconds = coefficients . features."""

    name: str
    coefficients: tuple[float, ...]
    nonzero: tuple[tuple[int, float], ...] = field(init=False, repr=False, compare=False)
    """(feature index, coefficient) of the features it charges: planning prices hundreds
    of thousands of batches a simulated minute, and most profiles leave features at 0."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(
                f"term {self.name!r} has {len(self.coefficients)} coefficients, "
                f"expected {len(FEATURES)} ({', '.join(FEATURES)})"
            )
        for feature, value in zip(FEATURES, self.coefficients, strict=True):
            if not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"term {self.name!r}: coefficient {feature} must be finite and >= 0, "
                    f"got {value!r}"
                )
        charged = tuple((i, c) for i, c in enumerate(self.coefficients) if c)
        object.__setattr__(self, "nonzero", charged)

    def seconds(self, x: tuple[float, ...]) -> float:
        total = 0.0
        for i, c in self.nonzero:
            total += c * x[i]
        return total


class BatchTimeModel(Protocol):
    """What planners query: PerfModel, or a CalibratedPerfModel (replica.perf_calibration)
    that scales it by online drift factors."""

    @property
    def tp(self) -> int: ...

    def predict(self, shape: BatchShape) -> float: ...

    def predict_aggregate(
        self,
        *,
        num_tokens: int,
        num_requests: int,
        attn_tokens: int,
        draft_steps: int = 0,
        draft_batch: int = 0,
        kv_tokens: int | None = None,
        padded_attn_tokens: int | None = None,
    ) -> float: ...

    def max_new_tokens_within(
        self,
        time_limit_s: float,
        *,
        num_requests: int,
        base_tokens: int,
        base_attn_tokens: int,
        context_per_new_token: int = 0,
        draft_steps: int = 0,
        draft_batch: int = 0,
        base_kv_tokens: int | None = None,
    ) -> int: ...


@dataclass(frozen=True)
class PerfModel:
    """T = max over terms of coefficients . features, in seconds."""

    terms: tuple[Term, ...]
    info: ProfileInfo

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return reduce_frozen(self)

    def __post_init__(self) -> None:
        if not self.terms:
            raise ValueError("a perf model needs at least one term")
        if all(t.coefficients[_TOKENS] == 0 and t.coefficients[_KV] == 0 for t in self.terms):
            raise ValueError(
                "a perf model must charge for tokens or kv_tokens in at least one term "
                "(otherwise max_new_tokens_within has no bound)"
            )

    @property
    def tp(self) -> int:
        return self.info.tp

    def predict_features(self, features: BatchFeatures) -> float:
        return self._seconds(features.vector())

    def least_work_seconds(self, requests: Iterable[tuple[int, int]]) -> float:
        """The least step time serving these (prompt_len, output_len) requests adds to any
        schedule that does not speculate: each prompt in one chunk, then one decode step per
        later token, with no step's fixed cost (steps share it) and no padding.

        Every other feature of a batch is the sum of its requests' own, and coefficients are
        non-negative, so the steps' features add up to at least the requests' summed; the
        max over terms of a sum is at most the sum of the steps' maxima. At full occupancy
        that caps the rate any scheduler can sustain on this profile. (Summing each request's
        own max instead would overstate it when terms differ.)
        """
        total = [0.0] * len(FEATURES)
        for prompt_len, output_len in requests:
            for i, v in enumerate(_least_vector(prompt_len, output_len)):
                total[i] += v
        total[_CONST] = 0.0
        return self._seconds(tuple(total))

    def predict(self, shape: BatchShape) -> float:
        """Seconds for one step of this exact batch."""
        if shape.tp != self.tp:
            raise ValueError(f"batch shape has tp={shape.tp} but the model is for tp={self.tp}")
        return self.predict_features(shape.features())

    def predict_aggregate(
        self,
        *,
        num_tokens: int,
        num_requests: int,
        attn_tokens: int,
        draft_steps: int = 0,
        draft_batch: int = 0,
        kv_tokens: int | None = None,
        padded_attn_tokens: int | None = None,
    ) -> float:
        """Seconds from aggregate features (see BatchFeatures).

        Without `kv_tokens` the model assumes kv_tokens = attn_tokens: exact for a batch of plain
        decodes and an upper bound otherwise (each request reads at most as many KV entries as it
        has attention pairs). Without `padded_attn_tokens` it assumes ragged attention
        (padded_attn_tokens = attn_tokens), which underestimates a padded backend's mixed
        batches; profiles whose padded coefficient is 0 (analytic GPU ones) do not care."""
        kv = attn_tokens if kv_tokens is None else kv_tokens
        padded = attn_tokens if padded_attn_tokens is None else padded_attn_tokens
        counts = (num_tokens, num_requests, attn_tokens, kv, padded, draft_steps, draft_batch)
        valid = {*map(type, counts)} == _INT and min(counts) >= 0
        if not valid or (draft_steps == 0) != (draft_batch == 0) or draft_batch > num_requests:
            # The slow path: constructing the features raises the precise ValueError.
            features = BatchFeatures(
                num_tokens=num_tokens,
                num_requests=num_requests,
                attn_tokens=attn_tokens,
                kv_tokens=kv,
                draft_steps=draft_steps,
                draft_batch=draft_batch,
                padded_attn_tokens=padded,
            )
            return self.predict_features(features)
        x = _vector(num_tokens, num_requests, attn_tokens, kv, padded, draft_steps, draft_batch)
        return self._seconds(x)

    def max_new_tokens_within(
        self,
        time_limit_s: float,
        *,
        num_requests: int,
        base_tokens: int,
        base_attn_tokens: int,
        context_per_new_token: int = 0,
        draft_steps: int = 0,
        draft_batch: int = 0,
        base_kv_tokens: int | None = None,
    ) -> int:
        """The most extra prefill tokens x the batch can take with predicted time <= the limit.

        Adding x tokens adds x to num_tokens, x * context_per_new_token to attn_tokens (the keys
        each new token attends to, itself included) and x to kv_tokens (so also to the draft's
        KV feature). Every term is linear in
        x, so each gives a closed-form bound and the answer is the smallest; a final check
        against `predict_aggregate` absorbs float rounding. Returns 0 when even the base batch
        misses the limit. `base_kv_tokens` defaults to `base_attn_tokens` (exact for decodes);
        attention is taken as ragged (see predict_aggregate)."""
        if not math.isfinite(time_limit_s):
            raise ValueError(f"time_limit_s must be finite, got {time_limit_s!r}")
        _check_count("context_per_new_token", context_per_new_token)
        base_kv = base_attn_tokens if base_kv_tokens is None else base_kv_tokens

        def seconds(extra: int) -> float:
            return self.predict_aggregate(
                num_tokens=base_tokens + extra,
                num_requests=num_requests,
                attn_tokens=base_attn_tokens + extra * context_per_new_token,
                draft_steps=draft_steps,
                draft_batch=draft_batch,
                kv_tokens=base_kv + extra,
            )

        if seconds(0) > time_limit_s:
            return 0
        base_x = _vector(
            base_tokens,
            num_requests,
            base_attn_tokens,
            base_kv,
            base_attn_tokens,
            draft_steps,
            draft_batch,
        )
        draft_kv_per_token = draft_steps * draft_batch / num_requests if num_requests else 0.0
        bound = math.inf
        for term in self.terms:
            a = term.coefficients
            per_pair = a[_ATTN] + a[_PADDED]
            per_kv = a[_KV] + a[_DRAFT_KV] * draft_kv_per_token
            slope = a[_TOKENS] + per_pair * context_per_new_token + per_kv
            if slope > 0:
                bound = min(bound, (time_limit_s - term.seconds(base_x)) / slope)
        extra = max(0, math.floor(bound))
        while extra > 0 and seconds(extra) > time_limit_s:
            extra -= 1
        while seconds(extra + 1) <= time_limit_s:
            extra += 1
        return extra

    def _seconds(self, x: tuple[float, ...]) -> float:
        return max([t.seconds(x) for t in self.terms])

    def slowed(self, slowdown: Slowdown) -> PerfModel:
        """This model on hardware `slowdown` says is slower (see Slowdown)."""
        factor, overhead_s = slowdown.factor, slowdown.overhead_s
        terms = tuple(
            replace(
                t,
                coefficients=tuple(
                    c * factor + (overhead_s if i == _CONST else 0.0)
                    for i, c in enumerate(t.coefficients)
                ),
            )
            for t in self.terms
        )
        note = f"slowed: {slowdown}"
        return replace(self, terms=terms, info=replace(self.info, notes=(*self.info.notes, note)))

    def to_dict(self) -> dict[str, Any]:
        info = self.info
        return {
            "format": FORMAT,
            "source": info.source,
            "backend": info.backend,
            "device": info.device,
            "model": info.model,
            "draft": info.draft,
            "dtype": info.dtype,
            "tp": info.tp,
            "date": info.date,
            "r2": info.r2,
            "mape": info.mape,
            "features": list(FEATURES),
            "terms": [
                {"name": t.name, "coefficients": dict(zip(FEATURES, t.coefficients, strict=True))}
                for t in self.terms
            ],
            "notes": list(info.notes),
            "assumptions": dict(info.assumptions),
            "fit": dict(info.fit),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerfModel:
        if data.get("format") != FORMAT:
            raise ValueError(
                f"not a perf profile: format is {data.get('format')!r}, expected {FORMAT!r}"
            )
        if list(data.get("features", [])) != list(FEATURES):
            raise ValueError(f"profile features {data.get('features')!r} differ from {FEATURES}")
        missing_fields = [key for key in PROFILE_FIELDS if key not in data]
        if missing_fields:
            raise ValueError(f"not a perf profile: it has no {', '.join(missing_fields)}")
        if not isinstance(data["terms"], list):
            raise ValueError(f"profile terms must be a list, got {data['terms']!r}")
        terms = []
        for raw in data["terms"]:
            if not (
                isinstance(raw, dict)
                and isinstance(raw.get("name"), str)
                and isinstance(raw.get("coefficients"), dict)
            ):
                raise ValueError(f"a profile term must be {{name, coefficients}}, got {raw!r}")
            coefficients = raw["coefficients"]
            missing = set(FEATURES) - set(coefficients)
            if missing:
                raise ValueError(f"term {raw['name']!r} lacks coefficients {sorted(missing)}")
            values = [coefficients[f] for f in FEATURES]
            if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
                raise ValueError(f"term {raw['name']!r}: coefficients must be numbers")
            terms.append(Term(raw["name"], tuple(float(v) for v in values)))
        info = ProfileInfo(
            source=data["source"],
            backend=data["backend"],
            device=data["device"],
            model=data["model"],
            draft=data.get("draft"),
            dtype=data.get("dtype", "bfloat16"),
            tp=int(data.get("tp", 1)),
            date=data.get("date", ""),
            r2=data.get("r2"),
            mape=data.get("mape"),
            notes=tuple(data.get("notes", ())),
            assumptions=dict(data.get("assumptions", {})),
            fit=dict(data.get("fit", {})),
        )
        return cls(terms=tuple(terms), info=info)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PerfModel:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a perf profile: {path} is not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"not a perf profile: {path} holds a {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def synthetic(cls, *terms: dict[str, float], note: str = "", tp: int = 1) -> PerfModel:
        """A model from hand-set coefficients (features left out are 0).

        For worked examples stated in round numbers (the paper's "6 tokens per time unit"),
        tests and simulations of hypothetical hardware; marked analytic, device "synthetic".
        """
        built = []
        for i, coefficients in enumerate(terms):
            unknown = sorted(set(coefficients) - set(FEATURES))
            if unknown:
                raise ValueError(f"unknown features {unknown}; known: {list(FEATURES)}")
            built.append(Term(f"t{i}", tuple(float(coefficients.get(f, 0.0)) for f in FEATURES)))
        info = ProfileInfo(
            source="analytic",
            backend="synthetic",
            device="synthetic",
            model="synthetic",
            tp=tp,
            notes=(note,) if note else (),
        )
        return cls(terms=tuple(built), info=info)
