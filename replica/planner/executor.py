"""Runs batch plans on token counts with the perf model as the clock.

The engine's twin for tests and the simulator: a prefill chunk that reaches the end of the
known tokens samples one token, a decode step appends accepted drafts plus one, preemption
drops the KV and keeps the tokens. Token ids are a function of (request, position), so a
resumed request produces exactly the tokens it would have had. It refuses plans that overrun
the cache or feed tokens a request does not have, which makes it a referee as well. A request
may carry a true output length the scheduler never sees (`stop_after`): it ends there as if the
model had sampled EOS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol

from replica.batch import (
    BatchOutcome,
    BatchPlan,
    DecodeStep,
    FinishReason,
    PrefillChunk,
    RequestOutcome,
)
from replica.kv_cache import PrefixPicture, prefix_limit
from replica.perf_model import BatchShape, BatchTimeModel
from replica.planner.adaserve import AdaServeTrees
from replica.planner.base import CacheBudget, Scheduler, leading_tokens
from replica.planner.specserve import SpecServeLengths, drafted_length
from replica.request import Request
from replica.spec.tree import TokenTree, judged_nodes

AcceptFn = Callable[[str, int], int]
"""(request id, drafted tokens) -> accepted drafts."""
ConfideFn = Callable[[str, int], tuple[list[float], list[bool]]]
"""(request id, drafted tokens) -> each draft's confidence and whether the target accepts it."""


@dataclass(frozen=True)
class Verified:
    """One drafting decode's verify as a policy ran it: drafts (or tree nodes) verified, the
    accepted ones, and the judged ones where a chain's count does not hold (a tree's)."""

    drafted: int
    accepted: int
    judged: int | None = None


class TreeDraft(Protocol):
    """A simulated draft for AdaServe's trees (cluster.sim_spec.SimulatedTrees)."""

    def candidate(self, request_id: str, depth: int, width: int) -> TokenTree:
        """The candidate tree the draft grows (f: each node's chance of acceptance)."""
        ...

    def walk(self, request_id: str, tree: TokenTree) -> list[int]:
        """The nodes of `tree` the target accepts in one verify, root to leaf."""
        ...


OUTPUT_TOKENS = 4096
"""The ids the simulated engine outputs are below this (but those a request `emits`)."""

Emits = Sequence[tuple[int, int]]
"""(output position, token id): tokens a simulated request outputs at set places."""


def token_id(request_id: str, position: int, emits: Emits = ()) -> int:
    """The token a request has at output position `position` (deterministic)."""
    return token_ids(request_id, position, 1, emits)[0]


def token_ids(request_id: str, start: int, count: int, emits: Emits = ()) -> list[int]:
    """The tokens a request has at output positions `start` to `start + count - 1`; `emits`
    puts given tokens at given positions (a reasoning model's end of thinking)."""
    base = _id_sum(request_id) * 31
    out = [(base + position * 7) % OUTPUT_TOKENS for position in range(start, start + count)]
    for position, token in emits:
        if start <= position < start + count:
            out[position - start] = token
    return out


@lru_cache(maxsize=4096)
def _id_sum(request_id: str) -> int:
    # Once per request rather than once per token: simulations produce millions of tokens.
    return sum(map(ord, request_id))


@dataclass
class _Sequence:
    request: Request
    output: list[int] = field(default_factory=list)
    computed: int = 0
    finished: bool = False
    stop_after: int | None = None
    cached: int = 0
    """Of `computed`, the leading tokens a prefix cache held (`start_from`)."""
    emits: Emits = ()

    @property
    def num_known(self) -> int:
        return self.request.prompt_len + len(self.output)

    def known(self, upto: int) -> list[int]:
        """Its first `upto` known tokens (prompt, then output)."""
        return leading_tokens(self.request.prompt_token_ids, self.output, upto)

    @property
    def own_computed(self) -> int:
        """Computed tokens in blocks of its own: a cached prefix's blocks are the cache's."""
        return self.computed - self.cached


def leading_accepted(accepted_each: Sequence[bool]) -> int:
    """Drafts accepted in one verify: those before the first refusal."""
    count = 0
    for ok in accepted_each:
        if not ok:
            break
        count += 1
    return count


class PerfExecutor:
    """Executes plans against a perf model; records when every token came out."""

    def __init__(
        self,
        perf: BatchTimeModel,
        cache: CacheBudget,
        accept: AcceptFn | None = None,
        specserve: tuple[SpecServeLengths, ConfideFn] | None = None,
        adaserve: tuple[AdaServeTrees, TreeDraft] | None = None,
        prefixes: PrefixPicture | None = None,
    ):
        """`specserve`: draft and verify only the drafts SpecServe keeps, from the
        confidences and verdicts the hook draws (it then decides acceptance, not `accept`).
        `adaserve`: verify each step's planned drafts as AdaServe's token trees, grown and
        walked by the `TreeDraft` (which then decides acceptance). `prefixes`: the replica's
        prefix cache (`attach_prefixes`), which keeps what its steps computed."""
        self.perf = perf
        self.cache = cache
        self.accept = accept
        self.specserve = specserve
        self.adaserve = adaserve
        self.prefixes = prefixes
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache, and those found there (`prefix_hits`)."""
        self.prefix_hits = 0
        self.sequences: dict[str, _Sequence] = {}
        self.token_times: dict[str, list[float]] = {}
        self.peak_blocks = 0
        self.preemptions: list[str] = []
        self.preempted_tokens = 0
        """KV tokens preemption dropped: work a resumed request computes again."""
        self.drafted: list[int] = []
        """Speculative tokens verified by every decode step executed, in order."""
        self.accepted_drafts = 0
        """Of those, the ones accepted."""

    def add(
        self,
        request: Request,
        output: Sequence[int] = (),
        computed: int = 0,
        stop_after: int | None = None,
        emits: Emits = (),
    ) -> None:
        """Track a request; `output` and `computed` resume one already under way. With
        `stop_after` the request stops (FinishReason.STOP) after that many output tokens;
        `emits` are tokens it outputs at set positions (`token_ids`)."""
        if request.request_id in self.sequences:
            raise ValueError(f"request {request.request_id!r} is already known")
        if not 0 <= computed <= request.prompt_len + len(output):
            raise ValueError(f"computed={computed} exceeds the request's known tokens")
        if stop_after is not None and not len(output) < stop_after <= request.sampling.max_tokens:
            raise ValueError(
                f"stop_after={stop_after} must be in ({len(output)}, "
                f"max_tokens={request.sampling.max_tokens}]"
            )
        self.sequences[request.request_id] = _Sequence(
            request, list(output), computed, False, stop_after, emits=emits
        )
        self.token_times[request.request_id] = []
        if self.prefixes is not None and not output and request.sampling.prompt_logprobs is None:
            self.prefixes.touch(request.prompt_token_ids)

    def attach_prefixes(self, plan: BatchPlan) -> bool:
        """Start the requests `plan` begins to prefill from the prefix the replica's cache
        holds, as a live replica does (Engine.attach_prefix), after the requests it preempts
        left what they computed cached (a live replica's registered blocks stay). True when
        one started from a hit: the plan, made without knowing of it, must then be fitted
        (cluster.plans.reconcile)."""
        if self.prefixes is None:
            return False
        for rid in plan.preempt:
            seq = self.sequences[rid]
            self.prefixes.remember(seq.known(seq.computed))
        hit = False
        for entry in plan.entries:
            seq = self.sequences[entry.request_id]
            if isinstance(entry, PrefillChunk) and not seq.computed:
                known = seq.num_known
                cached = self.prefixes.cached(seq.known(prefix_limit(known, len(seq.output))))
                self.start_from(entry.request_id, cached)
                self.prefix_queries += known
                self.prefix_hits += cached
                hit = hit or cached > 0
        return hit

    def start_from(self, request_id: str, computed: int) -> None:
        """Begin a request that holds no KV from `computed` tokens a prefix cache held, at
        most what the engine would take (replica.kv_cache.prefix_limit)."""
        seq = self.sequences[request_id]
        known = seq.num_known
        if (
            seq.finished
            or seq.computed
            or not 0 <= computed <= prefix_limit(known, len(seq.output))
        ):
            raise ValueError(
                f"cannot start {request_id!r} from {computed} cached tokens "
                f"({seq.computed} computed, {known} known)"
            )
        seq.computed = seq.cached = computed

    def release(self, request_id: str) -> list[float]:
        """Forget a finished request and return its token times: a long simulation keeps
        only live requests, so a step costs the same at its end as at its start."""
        if not self.sequences[request_id].finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self.sequences[request_id]
        return self.token_times.pop(request_id)

    def output(self, request_id: str) -> list[int]:
        return list(self.sequences[request_id].output)

    def shape(self, plan: BatchPlan) -> BatchShape:
        return BatchShape.of_plan(plan, lambda rid: self.sequences[rid].computed, self.perf.tp)

    def execute(self, plan: BatchPlan, now: float) -> tuple[BatchOutcome, float]:
        """Run one step starting at `now`; returns the outcome and the step's duration."""
        for rid in plan.preempt:
            self.preempted_tokens += self.sequences[rid].computed
            self.sequences[rid].computed = self.sequences[rid].cached = 0
            self.preemptions.append(rid)
        self._check_memory(plan)
        shape = self.shape(plan)
        verified: dict[int, Verified] = {}
        if self.specserve is not None:
            shape, verified = self._specserve(plan, shape, *self.specserve)
        elif self.adaserve is not None:
            shape, verified = self._adaserve(plan, shape, now, *self.adaserve)
        duration = self.perf.predict(shape)
        end = now + duration
        outcomes = [
            self._run_entry(entry, end, verified.get(i)) for i, entry in enumerate(plan.entries)
        ]
        free = self.cache.num_blocks - self._held_blocks()
        outcome = BatchOutcome(outcomes=outcomes, target_s=duration, free_blocks=free)
        if self.adaserve is not None and verified:
            outcome.draft_steps, outcome.draft_batch = shape.draft_steps, shape.draft_batch
        if self.prefixes is not None:
            self._remember(plan, outcomes, self.prefixes)
        return outcome, duration

    def _remember(
        self, plan: BatchPlan, outcomes: list[RequestOutcome], prefixes: PrefixPicture
    ) -> None:
        """The replica's cache keeps a finished request's prompt and output (all but the last
        token, never computed), then what the step's prefills computed."""
        for result in outcomes:
            if result.finished:
                seq = self.sequences[result.request_id]
                prefixes.remember(seq.known(seq.num_known - 1))
        for entry in plan.entries:
            seq = self.sequences[entry.request_id]
            if isinstance(entry, PrefillChunk) and not seq.finished:
                prefixes.remember(seq.known(seq.computed))

    def _specserve(
        self, plan: BatchPlan, shape: BatchShape, lengths: SpecServeLengths, confide: ConfideFn
    ) -> tuple[BatchShape, dict[int, Verified]]:
        """The step as SpecServe runs it, and each drafting entry's verify: the drafter stops a
        request below its floor, the verifier trims the rest.
        Simulated drafts are judged as greedy ones are (whatever is cut, the target keeps its
        own choice), with the greedy calibration."""
        spec = [
            i
            for i, e in enumerate(plan.entries)
            if isinstance(e, DecodeStep) and e.num_spec_tokens > 0
        ]
        floors = lengths.draft_floors(shape, spec)
        draws: dict[int, tuple[list[float], list[bool]]] = {}
        for i, floor in zip(spec, floors, strict=True):
            entry = plan.entries[i]
            confidences, accepted = confide(entry.request_id, shape.new_tokens[i] - 1)
            n = drafted_length(lengths.greedy.chances(confidences), floor)
            draws[i] = (confidences[:n], accepted[:n])
        new_tokens = list(shape.new_tokens)
        for i, (confidences, _) in draws.items():
            new_tokens[i] = 1 + len(confidences)
        drafting = [len(c) for c, _ in draws.values()]
        drafted = BatchShape(
            tuple(new_tokens), shape.context, max(drafting, default=0), len(drafting), shape.tp
        )
        decodes = sum(1 for e in plan.entries if isinstance(e, DecodeStep))
        chances = {i: lengths.greedy.chances(c) for i, (c, _) in draws.items()}
        kept = lengths.verify_lengths(drafted, chances, decodes)
        verified = {}
        for i, n in kept.items():
            new_tokens[i] = 1 + n
            confidences, accepted = draws[i]
            verified[i] = Verified(n, leading_accepted(accepted[:n]))
            lengths.greedy.observe(confidences[:n], verified[i].accepted)
        final = BatchShape(
            tuple(new_tokens), shape.context, drafted.draft_steps, drafted.draft_batch, shape.tp
        )
        return final, verified

    def _adaserve(
        self,
        plan: BatchPlan,
        shape: BatchShape,
        now: float,
        policy: AdaServeTrees,
        draft: TreeDraft,
    ) -> tuple[BatchShape, dict[int, Verified]]:
        """The step with AdaServe's trees in place of the planned chains, as a live replica
        runs it for greedy requests (replica.engine; the simulated ones all take trees), and
        each drafting decode's verify. The
        draft grows `depth` levels, priced as `depth` draft steps of its requests (the profile
        prices a draft step per request: the `width` rows of a level are taken to cost what
        one does, as for a small draft that reads its weights once per step); the plan's own
        split is kept when the trees' KV would not fit."""
        spec = [
            i
            for i, e in enumerate(plan.entries)
            if isinstance(e, DecodeStep) and e.num_spec_tokens > 0
        ]
        if not spec:
            return shape, {}
        planned = [shape.new_tokens[i] - 1 for i in spec]
        budget = sum(planned)
        depth, width = policy.shape(budget, len(spec), max(planned))
        seqs = [self.sequences[plan.entries[i].request_id] for i in spec]
        trees = [
            draft.candidate(
                s.request.request_id,
                min(depth, s.request.sampling.max_tokens - len(s.output) - 1),
                width,
            )
            for s in seqs
        ]
        needs = policy.needs([(s.request, len(s.output)) for s in seqs], shape, now)

        def fits(chosen: list[list[int]]) -> bool:
            fed = _fed(plan)
            for s, nodes in zip(seqs, chosen, strict=True):
                fed[s.request.request_id] = 1 + len(nodes)
            blocks = self._blocks(fed)
            if blocks > self.cache.num_blocks:
                return False
            self.peak_blocks = max(self.peak_blocks, blocks)
            return True

        chosen = policy.choose(trees, needs, budget, planned, depth, fits)
        new_tokens = list(shape.new_tokens)
        verified = {}
        for i, s, tree, nodes in zip(spec, seqs, trees, chosen, strict=True):
            new_tokens[i] = 1 + len(nodes)
            kept = tree.subtree(nodes)
            accepted = draft.walk(s.request.request_id, kept)
            verified[i] = Verified(len(nodes), len(accepted), judged_nodes(kept, accepted))
        trees_shape = BatchShape(tuple(new_tokens), shape.context, depth, len(spec), shape.tp)
        return trees_shape, verified

    def _run_entry(
        self,
        entry: DecodeStep | PrefillChunk,
        end: float,
        verified: Verified | None = None,
    ) -> RequestOutcome:
        """`verified`: SpecServe's or AdaServe's verify of a drafting decode."""
        rid = entry.request_id
        seq = self.sequences[rid]
        if seq.finished:
            raise ValueError(f"request {rid!r} is already finished")
        output = seq.output
        produced = len(output)
        known = seq.num_known
        new: list[int] = []
        drafted = accepted = 0
        judged: int | None = None
        if isinstance(entry, PrefillChunk):
            if entry.num_tokens > known - seq.computed:
                raise ValueError(
                    f"prefill of {entry.num_tokens} tokens for {rid!r} exceeds "
                    f"its {known - seq.computed} uncomputed tokens"
                )
            seq.computed += entry.num_tokens
            if seq.computed == known:
                new = token_ids(rid, produced, 1, seq.emits)
        else:
            if known - seq.computed != 1 or not output:
                raise ValueError(f"request {rid!r} is not decoding")
            drafted = entry.num_spec_tokens
            remaining = seq.request.sampling.max_tokens - produced
            if drafted > remaining - 1:
                raise ValueError(f"{rid!r} speculates {drafted} tokens with {remaining} to go")
            if verified is not None:
                drafted, accepted, judged = verified.drafted, verified.accepted, verified.judged
            elif self.accept is not None and drafted > 0:
                accepted = min(max(0, self.accept(rid, drafted)), drafted)
            self.drafted.append(drafted)
            self.accepted_drafts += accepted
            count = accepted + 1
            if seq.stop_after is not None:
                count = min(count, seq.stop_after - produced)
            new = token_ids(rid, produced, count, seq.emits)
            seq.computed = known + count - 1
        output.extend(new)
        self.token_times[rid].extend([end] * len(new))
        reason = None
        if seq.stop_after is not None and len(output) >= seq.stop_after:
            reason = FinishReason.STOP
        elif len(output) >= seq.request.sampling.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            seq.finished = True
            seq.computed = seq.cached = 0
        return RequestOutcome(
            request_id=rid,
            new_token_ids=new,
            num_computed_tokens=seq.computed,
            num_draft_tokens=drafted,
            num_accepted_tokens=accepted,
            num_judged_drafts=judged,
            finish_reason=reason,
        )

    def _blocks(self, fed: dict[str, int]) -> int:
        """KV blocks every request holds once it has cached the tokens `fed` to it."""
        return sum(
            self.cache.blocks_for(s.own_computed + fed.get(rid, 0))
            for rid, s in self.sequences.items()
        )

    def _held_blocks(self) -> int:
        return sum(self.cache.blocks_for(s.own_computed) for s in self.sequences.values())

    def _check_memory(self, plan: BatchPlan) -> None:
        """The step's KV peak: every fed token (drafts included) needs a slot (a prefix
        started from a cache is in blocks the cache holds, which the planners, counting each
        request's computed tokens, count for every request that shares them)."""
        blocks = self._blocks(_fed(plan))
        self.peak_blocks = max(self.peak_blocks, blocks)
        if blocks > self.cache.num_blocks:
            raise ValueError(
                f"plan needs {blocks} KV blocks; the cache has {self.cache.num_blocks}"
            )


def _fed(plan: BatchPlan) -> dict[str, int]:
    """Tokens each entry of the plan feeds (a decode: its drafts and its last token)."""
    fed = {e.request_id: e.num_tokens for e in plan.entries if isinstance(e, PrefillChunk)}
    fed.update(
        {e.request_id: e.num_spec_tokens + 1 for e in plan.entries if isinstance(e, DecodeStep)}
    )
    return fed


def run_workload(
    scheduler: Scheduler,
    executor: PerfExecutor,
    requests: Sequence[Request],
    *,
    max_steps: int = 100_000,
    emits: Mapping[str, Emits] | None = None,
) -> float:
    """Feed requests at their arrival times, run plans until all finish; returns the end time.
    `emits`: per request id, the tokens it outputs at set positions (`token_ids`)."""
    arrivals = sorted(requests, key=lambda r: r.arrival_time)
    now = arrivals[0].arrival_time if arrivals else 0.0
    nxt = 0
    for _ in range(max_steps):
        while nxt < len(arrivals) and arrivals[nxt].arrival_time <= now:
            emitted = () if emits is None else emits.get(arrivals[nxt].request_id, ())
            executor.add(arrivals[nxt], emits=emitted)
            scheduler.add_request(arrivals[nxt], now)
            nxt += 1
        plan = scheduler.schedule(now)
        if plan is None:
            if nxt < len(arrivals):
                now = arrivals[nxt].arrival_time
                continue
            if not scheduler.has_unfinished():
                return now
            raise RuntimeError("the scheduler has unfinished requests but planned nothing")
        outcome, duration = executor.execute(plan, now)
        now += duration
        scheduler.update_from_outcome(plan, outcome, now)
    raise RuntimeError(f"workload did not finish within {max_steps} steps")
