"""SpecServe's confidence-driven speculation lengths (seed paper 001).

The SLOs-Serve planner sizes each decode's drafts from one acceptance rate for all tokens. The
draft model knows more once it has drafted: with c_j the chance the target accepts draft j
given its confidence in it, the j-th draft of a request is accepted with probability
AR_j = c_1 ... c_j, and a step yields NAT = B + sum_j AR_j tokens (B decodes, each with its
bonus token). SpecServe keeps, of the planned drafts, those that raise the step's estimated
goodput NAT / T, with T the perf model's step time:

- the verifier drops the draft with the smallest AR (always a request's last: ARs only shrink
  along a request) while NAT / T grows, down to one per request: a draft the target will
  likely refuse still costs a verify slot, and where the step is compute-bound that slot
  slows every request in it;
- the drafter stops a request early, before its planned length, once the predicted AR of its
  next draft (AR_last x c_last, the product form, since the paper's raw c_last overestimates)
  falls below that draft's marginal worth: the last verified step's goodput times what one
  more verify token costs this step (not counting the draft's own forward, which the profile
  charges per draft step of the batch: the floor errs toward drafting).

SpecServe takes the draft's softmax probability as c_j, calibrated (its Fig. 7). A small draft's
is not: the demo draft's greedy drafts of confidence 0.1-0.2 were accepted 62% of the time
(`slos-serve bench specserve`), since a flat distribution can still have the target's argmax on
top. So c_j is learned per confidence bin from the verifies (`ConfidenceCalibration`), for
greedy and sampled drafts apart, and a calibrated draft keeps its own values. A sampled request
that draws without a seed keeps every draft the drafter made: its drafts are judged against
the draft's probability of the very token drawn, so dropping the unlikely ones would skew its
samples; only the drafter's early stop, decided from the tokens before, applies to it.

Dropping a draft never adds time, and it only forgoes a token the model expects to lose; the
planner, which charged the whole plan, sees the progress actually made and plans the next step
from it. Its acceptance estimate then sees only the drafts kept, the likelier ones, so it plans
somewhat longer drafts than it would without SpecServe, which SpecServe cuts back.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence

from replica.perf_model import BatchShape, BatchTimeModel


def acceptance_products(chances: Sequence[float]) -> list[float]:
    """AR_j = c_1 ... c_j: the chance the target accepts draft j (and so all before it)."""
    products = []
    running = 1.0
    for c in chances:
        running *= c
        products.append(running)
    return products


def keeps_drafting(chances: Sequence[float], floor: float) -> bool:
    """Whether the drafter proposes one more token after drafts accepted with `chances`: the
    first always, a later one while its predicted acceptance (their product times the last)
    clears `floor` (the kernel's greedy_chain applies the same rule in C)."""
    if floor <= 0.0 or not chances:
        return True
    return acceptance_products(chances)[-1] * chances[-1] >= floor


def drafted_length(chances: Sequence[float], floor: float) -> int:
    """How many of the drafts with `chances` the drafter makes (the first always)."""
    n = min(1, len(chances))
    while n < len(chances) and keeps_drafting(chances[:n], floor):
        n += 1
    return n


class ConfidenceCalibration:
    """The chance the target accepts a draft, per bin of the draft's confidence, from the
    verifies seen: judged drafts (up to the first refusal) count, each bin starting from its
    own confidence as a prior and forgetting by halving once it has seen `window` drafts."""

    def __init__(self, bins: int = 10, prior_weight: float = 4.0, window: int = 4000) -> None:
        if bins < 1 or not prior_weight > 0 or window < 1:
            raise ValueError(
                f"calibration needs bins >= 1, prior_weight > 0 and window >= 1, got "
                f"{bins}, {prior_weight}, {window}"
            )
        self.bins = bins
        self.window = window
        self.judged = [prior_weight] * bins
        self.accepted = [prior_weight * (b + 0.5) / bins for b in range(bins)]

    def _bin(self, confidence: float) -> int:
        if not confidence > 0.0:  # also NaN (a row shaped to nothing)
            return 0
        return min(self.bins - 1, int(confidence * self.bins))

    def table(self) -> list[float]:
        """Each bin's acceptance, lowest confidences first (what the C drafter looks up)."""
        return [a / j for a, j in zip(self.accepted, self.judged, strict=True)]

    def chance(self, confidence: float) -> float:
        b = self._bin(confidence)
        return self.accepted[b] / self.judged[b]

    def chances(self, confidences: Sequence[float]) -> list[float]:
        return [self.chance(c) for c in confidences]

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """One verify of drafts made with `confidences`, `accepted` of them accepted."""
        judged = min(len(confidences), accepted + 1)
        for j in range(judged):
            b = self._bin(confidences[j])
            self.judged[b] += 1.0
            if j < accepted:
                self.accepted[b] += 1.0
            if self.judged[b] > self.window:
                self.judged[b] /= 2.0
                self.accepted[b] /= 2.0


class SpecServeLengths:
    """The verifier's and the drafter's lengths over one perf model; keeps the last verified
    step's goodput estimate as the drafter's bar, and the calibrations of confidences: one for
    greedy drafts (the draft's top probability, accepted when it is the target's top token)
    and one for sampled drafts (the probability of the token drawn, accepted by the sampling
    rule), which measure different things."""

    def __init__(
        self,
        perf: BatchTimeModel,
        greedy: ConfidenceCalibration | None = None,
        sampled: ConfidenceCalibration | None = None,
    ):
        self.perf = perf
        self.greedy = greedy if greedy is not None else ConfidenceCalibration()
        self.sampled = sampled if sampled is not None else ConfidenceCalibration()
        self.rate = 0.0
        """Estimated tokens per second of the last verified step (0: none yet, draft all)."""

    def draft_floors(self, shape: BatchShape, decodes: Sequence[int]) -> list[float]:
        """For each entry index in `decodes` (as planned, with all its drafts), the least
        predicted acceptance its next draft needs to be worth drafting: the last step's goodput
        times the verify time that draft adds."""
        if self.rate <= 0.0 or not decodes:
            return [0.0] * len(decodes)
        step = _Step(shape)
        full = step.seconds(self.perf)
        return [
            self.rate * max(0.0, full - step.seconds(self.perf, less=i))
            if shape.new_tokens[i] > 1
            else 0.0
            for i in decodes
        ]

    def verify_lengths(
        self,
        shape: BatchShape,
        chances: Mapping[int, Sequence[float]],
        decodes: int,
        whole: Collection[int] = (),
    ) -> dict[int, int]:
        """How many of its drafts each entry in `chances` (entry index -> each draft's chance
        of acceptance, by its calibration) sends to verification: at least its first, so every
        confidence keeps being judged (a calibration that thought a bin hopeless would
        otherwise never learn it was wrong); the entries in `whole` count but keep all theirs.
        `shape` is the step as drafted; `decodes`: the step's decodes, each worth its bonus
        token. Records the kept step's goodput for the drafter (a step of prefills alone says
        nothing of it)."""
        kept = {i: len(c) for i, c in chances.items()}
        products = {i: acceptance_products(c) for i, c in chances.items()}
        nat = float(decodes)
        for p in products.values():
            nat += math.fsum(p)
        step = _Step(shape)
        seconds = step.seconds(self.perf)
        heap = [(p[-1], i) for i, p in products.items() if len(p) > 1 and i not in whole]
        heapq.heapify(heap)
        while heap:
            ar, i = heap[0]
            trimmed_s = step.seconds(self.perf, less=i)
            if (nat - ar) * seconds <= nat * trimmed_s:
                break
            heapq.heappop(heap)
            step.drop_token(i)
            seconds, nat = trimmed_s, nat - ar
            kept[i] -= 1
            if kept[i] > 1:
                heapq.heappush(heap, (products[i][kept[i] - 1], i))
        if decodes > 0 and seconds > 0:
            self.rate = nat / seconds
        return kept


class _Step:
    """A step's aggregate features, kept as its entries' query tokens drop one at a time: the
    price of one token fewer is then a few subtractions (the attention pairs of n tokens over
    context c fall by c + n), not the whole batch summed again for every candidate. The draft
    work stays: it is done by the time the verifier decides."""

    def __init__(self, shape: BatchShape) -> None:
        features = shape.features()
        self.new_tokens = list(shape.new_tokens)
        self.context = shape.context
        self.num_tokens = features.num_tokens
        self.attn_tokens = features.attn_tokens
        self.kv_tokens = features.kv_tokens
        self.draft_steps = shape.draft_steps
        self.draft_batch = shape.draft_batch
        self._longest()

    def _longest(self) -> None:
        """The two largest query lengths and KV lengths, for the padded slots' maxima."""
        kvs = [n + c for n, c in zip(self.new_tokens, self.context, strict=True)]
        self.top_q, self.next_q = [*heapq.nlargest(2, self.new_tokens), 0, 0][:2]
        self.top_kv, self.next_kv = [*heapq.nlargest(2, kvs), 0, 0][:2]

    def seconds(self, perf: BatchTimeModel, less: int = -1) -> float:
        """The step's time, with entry `less` feeding one token fewer (-1: as it is)."""
        tokens, attn, kv = self.num_tokens, self.attn_tokens, self.kv_tokens
        top_q, top_kv = self.top_q, self.top_kv
        if less >= 0:
            n, c = self.new_tokens[less], self.context[less]
            tokens, attn, kv = tokens - 1, attn - (c + n), kv - 1
            if n == top_q:
                top_q = max(n - 1, self.next_q)
            if n + c == top_kv:
                top_kv = max(n + c - 1, self.next_kv)
        return perf.predict_aggregate(
            num_tokens=tokens,
            num_requests=len(self.new_tokens),
            attn_tokens=attn,
            draft_steps=self.draft_steps,
            draft_batch=self.draft_batch,
            kv_tokens=kv,
            padded_attn_tokens=len(self.new_tokens) * top_q * top_kv,
        )

    def drop_token(self, index: int) -> None:
        n, c = self.new_tokens[index], self.context[index]
        self.num_tokens -= 1
        self.attn_tokens -= c + n
        self.kv_tokens -= 1
        self.new_tokens[index] = n - 1
        self._longest()
