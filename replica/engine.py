"""The replica engine: executes one `BatchPlan` and reports a `BatchOutcome`.

A step is: validate the whole plan (nothing changes if any part is wrong), drop the KV of
preempted requests, let the proposer draft tokens for speculative decodes (a draft model also
prefills the step's prefill chunks, so its cost lands in the step the perf model charges for
the prompt, not in a later decode; with SpecServe, drafting stops and verification keeps only
the drafts the draft's confidences make worth their time), run ONE target
forward over the ragged batch (prefill chunks, decode tokens, verify tokens), sample or verify,
roll both KV caches back to the accepted length and apply stop conditions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import llguidance
import torch
from tokenizers import Tokenizer

from replica.batch import (
    BatchOutcome,
    BatchPlan,
    DecodeStep,
    FinishReason,
    PlanEntry,
    PrefillChunk,
    RequestOutcome,
    TokenLogprob,
)
from replica.grammar import Grammar
from replica.grammar_vocab import grammar_tokenizer
from replica.kv_cache import KVCacheManager, prefix_limit
from replica.model_runner import ForwardSeq, KVMove, ModelRunner
from replica.model_source import REPLACEMENT_CHAR, load_tokenizer, model_dir
from replica.perf_model import BatchShape
from replica.planner.adaserve import AdaServeTrees
from replica.planner.specserve import ConfidenceCalibration, SpecServeLengths
from replica.request import Request
from replica.sampling import (
    LogitsShaper,
    make_generator,
    noisy_choice,
    position_noise,
    sample,
    token_probs,
)
from replica.spec.draft import (
    DraftJob,
    DraftModel,
    Proposal,
    SampledTreeJob,
    TreeJob,
    load_draft_vocab,
)
from replica.spec.ngram import NgramProposer
from replica.spec.tree import (
    TokenTree,
    judged_nodes,
    level_slots,
    template_tree,
    verify_tree_choices,
)
from replica.spec.verify import verify_choices, verify_stochastic, verify_tree_sampled
from replica.tensor_parallel import TensorParallel

ProposerKind = Literal["draft", "ngram"]
Detokenize = Callable[[list[int]], str]

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    """Engine-side state of one request."""

    request: Request
    generator: torch.Generator
    shaper: LogitsShaper | None = None
    """The request's grammar, bias, penalties and min_tokens; None when it has none (most
    requests)."""
    output: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Log-probabilities of prompt tokens 1, 2, ... computed so far (prompt_logprobs); they
    go out with the first token."""
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    abort_reason: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.output

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.request.prompt_token_ids[-1]

    @property
    def num_known(self) -> int:
        return self.request.prompt_len + len(self.output)

    @property
    def prefix_limit(self) -> int:
        """The most of its tokens a cached prefix may cover (kv_cache.prefix_limit)."""
        return prefix_limit(self.num_known, len(self.output))

    @property
    def is_decoding(self) -> bool:
        return bool(self.output) and self.num_known - self.num_computed == 1

    @property
    def grammar(self) -> Grammar | None:
        return None if self.shaper is None else self.shaper.grammar

    @property
    def generated(self) -> list[int]:
        """The request's whole output, with what it produced before a resume (now prompt)."""
        resumed = self.request.resumed_output
        return self.request.prompt_token_ids[self.request.prompt_len - resumed :] + self.output


@dataclass
class _Work:
    """One validated plan entry: the tokens it feeds and how many it may propose."""

    seq: _Seq
    entry: PlanEntry
    num_feed: int
    num_spec: int
    proposal: Proposal = field(default_factory=lambda: Proposal(tokens=[], probs=None))
    noise: torch.Tensor | None = None
    """A seeded request's noise for the positions this step may sample, when the draft made
    it; verification reuses it rather than drawing it again."""
    prompt_rows: tuple[int, int] | None = None
    """A prefill chunk's positions (first, last) whose logits give prompt log-probabilities
    not computed yet."""
    tree: TokenTree | None = None
    """AdaServe's drafted tree to verify (None: the proposal's chain, if any)."""
    tree_draws: dict[int, torch.Tensor] | None = None
    """A sampled tree's draft distributions, by parent node, its children drawn from them
    (None: a greedy tree, its children the draft's likeliest)."""

    def drop_drafts(self) -> None:
        """Verify nothing this step: a plain decode."""
        self.num_spec, self.noise, self.tree, self.tree_draws = 0, None, None, None
        self.proposal = Proposal(tokens=[], probs=None)


@dataclass
class _DraftRun:
    """What a step's proposing did."""

    seconds: float = 0.0
    tree_levels: int = 0
    """The draft forwards AdaServe's trees took (0: no trees this step)."""
    tree_requests: int = 0


class StepFailed(RuntimeError):
    """A step failed after it began: not a refusal (ValueError), its requests' state is
    unknown."""


class Engine:
    """Runs plans over a target `ModelRunner` and an optional proposer."""

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | None = None,
        *,
        proposer: ProposerKind | None = None,
        detokenize: Detokenize | None = None,
        ngram: NgramProposer | None = None,
        grammar_vocab: llguidance.LLTokenizer | None = None,
        specserve: SpecServeLengths | None = None,
        adaserve: AdaServeTrees | None = None,
        prefix_caching: bool = False,
    ) -> None:
        """`grammar_vocab`: the model's vocabulary for structured output
        (`replica.grammar_vocab.grammar_tokenizer`); None refuses requests with a grammar.
        `specserve`: draft and verify only the drafts SpecServe's confidences find worth their
        time (replica.planner.specserve); None: every planned draft. `adaserve`: verify token
        trees, the step's planned drafts spread over its requests by their SLOs
        (replica.planner.adaserve); None: chains. `prefix_caching`: both
        models' KV of committed tokens is kept for later requests that start with the same
        tokens (`attach_prefix`); off, as the profiler needs, unless asked for."""
        if proposer == "draft" and draft is None:
            raise ValueError("proposer 'draft' needs a draft model")
        if specserve is not None and proposer != "draft":
            raise ValueError("specserve needs the draft model's confidences: proposer 'draft'")
        if adaserve is not None and (proposer != "draft" or specserve is not None):
            raise ValueError("adaserve grows its trees with a draft model, without specserve")
        if proposer not in (None, "draft", "ngram"):
            raise ValueError(f"proposer must be 'draft', 'ngram' or None, got {proposer!r}")
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.vocab_size}) differs from the target's "
                f"({target.vocab_size})"
            )
        self.target = target
        self.cache = KVCacheManager(target.num_blocks, prefix_caching=prefix_caching)
        self.draft = (
            DraftModel(draft, prefix_caching) if draft is not None and proposer == "draft" else None
        )
        self.ngram = (ngram or NgramProposer()) if proposer == "ngram" else None
        self.detokenize = detokenize
        self.grammar_vocab = grammar_vocab
        self.specserve = specserve
        self.adaserve = adaserve
        self.eos_token_ids = frozenset(target.config.eos_token_ids)
        self._seqs: dict[str, _Seq] = {}

    @classmethod
    def from_dirs(
        cls,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        *,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        proposer: ProposerKind | None = None,
        tp: TensorParallel | None = None,
        specserve: SpecServeLengths | None = None,
        adaserve: AdaServeTrees | None = None,
        prefix_caching: bool = False,
    ) -> Engine:
        """Load the pair from HF folders or hub repo ids (`model_source`); the target's
        tokenizer (if any) detokenizes. With `tp` this process is rank 0 of the target's
        tensor-parallel group (the draft stays whole, here)."""
        if num_blocks is None and kv_memory_bytes is None:
            num_blocks = 1024
        target_dir = model_dir(target_dir)
        draft_dir = None if draft_dir is None else model_dir(draft_dir)
        target = ModelRunner(
            target_dir,
            num_blocks=num_blocks,
            kv_memory_bytes=kv_memory_bytes,
            dtype=dtype,
            device=device,
            tp=tp,
        )
        draft = None
        if draft_dir is not None:
            draft = ModelRunner(
                draft_dir,
                num_blocks=target.num_blocks,
                dtype=dtype,
                device=device,
                head_vocab=load_draft_vocab(draft_dir),
            )
        if proposer is None and draft is not None:
            proposer = "draft"
        tokenizer = load_tokenizer(target_dir)
        if tokenizer is None:
            return cls(
                target,
                draft,
                proposer=proposer,
                specserve=specserve,
                adaserve=adaserve,
                prefix_caching=prefix_caching,
            )
        grammar_vocab = None
        try:
            grammar_vocab = grammar_tokenizer(
                tokenizer, target.vocab_size, target.config.eos_token_ids
            )
        except ValueError as exc:  # no EOS, a vocabulary below the tokenizer's, WordPiece...
            log.warning("structured output is off: llguidance cannot use this model (%s)", exc)
        return cls(
            target,
            draft,
            proposer=proposer,
            detokenize=detokenizer(tokenizer),
            grammar_vocab=grammar_vocab,
            specserve=specserve,
            adaserve=adaserve,
            prefix_caching=prefix_caching,
        )

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len

    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def can_speculate(self) -> bool:
        return self.draft is not None or self.ngram is not None

    def add_request(self, request: Request) -> None:
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id!r} already exists")
        request.check_fits(self.max_model_len, self.target.vocab_size)
        if request.sampling.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        if request.sampling.grammar is not None and self.grammar_vocab is None:
            raise ValueError(
                "structured output needs a tokenizer llguidance can use; this engine has none"
            )
        self._seqs[request.request_id] = _Seq(request, make_generator(), self._shaper(request))

    def attach_prefix(self, request_id: str) -> int:
        """Start a request that holds no KV (new, or preempted) from the cached KV of its
        longest prefix other requests computed (whole blocks); returns its computed tokens.
        Some tokens are always left to feed (kv_cache.prefix_limit). A request that asked for
        prompt log-probabilities computes its whole prompt, as those come from the logits."""
        seq = self._get(request_id)
        if not self.looks_up_prefix(request_id):
            return seq.num_computed
        tokens = seq.tokens
        seq.num_computed = self.cache.attach_prefix(request_id, tokens, seq.prefix_limit)
        if self.draft is not None:
            self.draft.cache.attach_prefix(request_id, tokens, seq.num_computed)
        return seq.num_computed

    def touch_prefix(self, request_id: str) -> None:
        """Keep the cached blocks a request waiting for its prefill would start from to be
        taken last (KVCacheManager.touch): between the request's binding and its prefill,
        other requests' KV takes cached blocks least recently released first."""
        if self.looks_up_prefix(request_id):
            seq = self._get(request_id)
            tokens = seq.tokens
            self.cache.touch(tokens, seq.prefix_limit)
            if self.draft is not None:
                self.draft.cache.touch(tokens, seq.prefix_limit)

    def looks_up_prefix(self, request_id: str) -> bool:
        """Whether `attach_prefix` would look the request up: the cache is on, the request
        holds no KV, and it did not ask for prompt log-probabilities."""
        seq = self._get(request_id)
        return (
            self.cache.prefix_caching
            and not seq.num_computed
            and seq.request.sampling.prompt_logprobs is None
        )

    def abort(self, request_id: str) -> None:
        """Free the request's KV and forget it (also how finished requests are released)."""
        self._get(request_id)
        self._free_kv(request_id)
        del self._seqs[request_id]

    def preempt(self, request_id: str) -> None:
        """Drop the request's KV but keep its tokens; it resumes with prefill chunks."""
        seq = self._get(request_id)
        if seq.finish_reason is not None:
            raise ValueError(f"request {request_id!r} is finished; nothing to preempt")
        self._free_kv(request_id)
        seq.num_computed = 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    def output_token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).output)

    def finish_reason(self, request_id: str) -> FinishReason | None:
        return self._get(request_id).finish_reason

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def step(self, plan: BatchPlan) -> BatchOutcome:
        """Execute `plan`; a ValueError means the plan was refused and nothing changed. Once
        the plan runs, a ValueError is raised as StepFailed: KV may have moved by then, and
        the caller must not take the step for refused."""
        start = time.perf_counter()
        works = self._validate(plan)
        try:
            return self._run(plan, works, start)
        except ValueError as exc:
            raise StepFailed(f"the step failed after it began: {exc}") from exc

    def _run(self, plan: BatchPlan, works: list[_Work], start: float) -> BatchOutcome:
        for rid in plan.preempt:
            self.preempt(rid)
        drafting = self._propose_or_skip(works)
        draft_s = drafting.seconds + self._draft_prefill(works)
        seqs = [self._forward_seq(w) for w in works]
        target_start = time.perf_counter()
        logits, failed = self._forward(works, seqs)
        target_s = time.perf_counter() - target_start
        # One argmax for the whole batch: greedy requests need nothing else.
        choices = logits.argmax(dim=-1).tolist() if len(logits) else []
        outcomes = []
        row = 0
        for i, (w, fs) in enumerate(zip(works, seqs, strict=True)):
            if i in failed:
                outcomes.append(self._abort_entry(w.seq, "the model's forward pass"))
                continue
            rows = slice(row, row + fs.num_logits)
            try:
                outcomes.append(self._finish_entry(w, logits[rows], choices[rows]))
            except Exception:
                log.exception(
                    "request %s: its own work in the step (sampling, stops, grammar, "
                    "log-probabilities) failed; ending it as aborted, the step's other "
                    "requests go on",
                    w.seq.request.request_id,
                )
                outcomes.append(self._abort_entry(w.seq, "its sampling, stops or grammar"))
            row += fs.num_logits
        total = time.perf_counter() - start
        outcome = BatchOutcome(
            outcomes=outcomes,
            draft_s=draft_s,
            target_s=target_s,
            overhead_s=max(0.0, total - draft_s - target_s),
            free_blocks=self.cache.num_free_blocks,
        )
        if drafting.tree_levels:
            # The chains beside the trees ran their own draft steps after the levels.
            chains = [len(w.proposal.tokens) for w in works if w.proposal.tokens]
            outcome.draft_steps = drafting.tree_levels + max(chains, default=0)
            outcome.draft_batch = drafting.tree_requests + len(chains)
        return outcome

    def _get(self, request_id: str) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request {request_id!r}")
        return seq

    def _free_kv(self, request_id: str) -> None:
        self.cache.free(request_id)
        if self.draft is not None:
            self.draft.free(request_id)

    def _validate(self, plan: BatchPlan) -> list[_Work]:
        """Check every entry and the cache capacity of the whole plan before touching state."""
        for rid in plan.preempt:
            if self._get(rid).finish_reason is not None:
                raise ValueError(f"cannot preempt finished request {rid!r}")
        works = []
        for entry in plan.entries:
            seq = self._get(entry.request_id)
            if seq.finish_reason is not None:
                raise ValueError(f"request {entry.request_id!r} is already finished")
            uncomputed = seq.num_known - seq.num_computed
            if isinstance(entry, PrefillChunk):
                if entry.num_tokens > uncomputed:
                    raise ValueError(
                        f"request {entry.request_id!r}: prefill of {entry.num_tokens} tokens "
                        f"but only {uncomputed} are uncomputed"
                    )
                works.append(_Work(seq, entry, num_feed=entry.num_tokens, num_spec=0))
                continue
            if not seq.is_decoding:
                raise ValueError(
                    f"request {entry.request_id!r} is not decoding ({uncomputed} uncomputed "
                    f"tokens, {len(seq.output)} generated); feed it a prefill chunk"
                )
            k = entry.num_spec_tokens
            if k > 0 and not self.can_speculate:
                raise ValueError(
                    f"request {entry.request_id!r} asks for {k} speculative tokens but the "
                    "engine has no proposer"
                )
            remaining = seq.request.sampling.max_tokens - len(seq.output)
            works.append(_Work(seq, entry, num_feed=1, num_spec=min(k, remaining - 1)))
        self._check_capacity(plan, works)
        return works

    def _check_capacity(self, plan: BatchPlan, works: list[_Work]) -> None:
        freed = set(plan.preempt)
        target_free = self.cache.num_free_blocks + self.cache.blocks_released_by(freed)
        target_need = sum(
            self.cache.extra_blocks_needed(w.seq.request.request_id, w.num_feed + w.num_spec)
            for w in works
        )
        if target_need > target_free:
            raise ValueError(
                f"plan needs {target_need} KV blocks; {target_free} are free after preemption"
            )
        if self.draft is None:
            return
        draft_cache = self.draft.cache
        draft_free = draft_cache.num_free_blocks + draft_cache.blocks_released_by(freed)
        draft_need = self._draft_blocks(works)
        if draft_need > draft_free:
            raise ValueError(
                f"plan needs {draft_need} draft KV blocks; {draft_free} are free after preemption"
            )

    def _draft_blocks(self, works: Iterable[_Work]) -> int:
        """Draft KV blocks the works' planned chains and prefill chunks take."""
        assert self.draft is not None
        return sum(
            self.draft.blocks_needed(w.seq.request.request_id, _draft_tokens(w))
            for w in works
            if w.num_spec > 0 or isinstance(w.entry, PrefillChunk)
        )

    def _propose_or_skip(self, works: list[_Work]) -> _DraftRun:
        """`_propose`, or no drafts this step if proposing fails (one request's logits
        shaping, say): drafts only save time, so their failure must not fail the requests
        batched with the one that caused it. The draft cache goes back to where it was."""
        spec = [w for w in works if w.num_spec > 0]
        if not spec:
            return _DraftRun()
        draft = self.draft
        ids = [w.seq.request.request_id for w in spec]
        cached = [] if draft is None else [draft.cache.num_tokens(rid) for rid in ids]
        try:
            return self._propose(works, spec)
        except Exception:
            log.exception("proposing drafts failed; this step's decodes verify none")
        if draft is not None:
            for rid, n in zip(ids, cached, strict=True):
                draft.rollback(rid, n)
        for w in spec:
            w.drop_drafts()
        return _DraftRun()

    def _propose(self, works: list[_Work], spec: list[_Work]) -> _DraftRun:
        """Fill in the proposals (or AdaServe's trees) of the speculative decodes `spec`."""
        run = _DraftRun()
        start = time.perf_counter()
        grown: set[int] = set()
        if self.adaserve is not None:
            greedy = [w for w in spec if w.seq.request.sampling.greedy]
            sampled = [
                w
                for w in spec
                if not w.seq.request.sampling.greedy and w.seq.request.sampling.seed is None
            ]
            for group, grow in (
                (greedy, self._propose_trees),
                (sampled, self._propose_sampled_trees),
            ):
                levels = grow(works, group) if group else 0
                if levels:
                    run.tree_levels += levels
                    run.tree_requests += len(group)
                    grown |= {id(w) for w in group}
        chains = [w for w in spec if id(w) not in grown]
        if self.ngram is not None:
            for w in spec:
                w.proposal = Proposal(self.ngram.propose(w.seq.tokens, w.num_spec), None)
        elif self.draft is not None and chains:
            for w in chains:
                params = w.seq.request.sampling
                if params.seed is not None and not params.greedy:
                    w.noise = position_noise(
                        params.seed, len(w.seq.tokens), w.num_spec + 1, self.target.vocab_size
                    )
            floors = self._draft_floors(works, chains)
            jobs = [
                DraftJob(
                    w.seq.request.request_id,
                    w.seq.tokens,
                    w.num_spec,
                    w.seq.request.sampling,
                    w.seq.generator,
                    None if w.noise is None else w.noise[: w.num_spec],
                    w.seq.shaper,
                    self._calibration(w),
                    floor,
                )
                for w, floor in zip(chains, floors, strict=True)
            ]
            for w, proposal in zip(chains, self.draft.propose(jobs), strict=True):
                w.proposal = proposal
            self._trim_proposals(works)
            for w in chains:
                if w.noise is not None:
                    w.noise = w.noise[: len(w.proposal.tokens) + 1]
        run.seconds = time.perf_counter() - start
        return run

    def _propose_trees(self, works: list[_Work], spec: list[_Work]) -> int:
        """AdaServe: grow candidate trees with the draft and give each greedy speculative
        decode (`spec`) the nodes `AdaServeTrees.choose` picks within their planned drafts (sampled
        requests: `_propose_sampled_trees`; a tree of the draft's top tokens verified as point
        masses accepted far fewer of them: 1.68 against 2.75 tokens per verify at temperature
        1, k = 4, the demo pair). Returns the levels the draft grew; 0 (nothing changed) when
        its cache cannot hold the trees this step: the chains run."""
        assert self.adaserve is not None and self.draft is not None
        adaserve = self.adaserve
        budget, depth, width = self._tree_budget(spec)
        jobs = [
            TreeJob(
                w.seq.request.request_id,
                w.seq.tokens,
                min(depth, self._tree_depth_limit(w)),
                w.seq.shaper,
            )
            for w in spec
        ]
        draft_need = sum(
            self.draft.blocks_needed(j.request_id, len(j.tokens) + level_slots(j.depth, width))
            for j in jobs
        )
        draft_need += self._draft_blocks(_others(works, spec))
        if draft_need > self.draft.cache.num_free_blocks:
            return 0
        drafted = self.draft.propose_trees(jobs, width, adaserve.calibration)
        for w in spec:
            self.draft.rollback(w.seq.request.request_id, w.seq.num_known)
        trees = [adaserve.calibrated(t) for t in drafted]
        chosen = self._select(works, spec, trees, budget, depth)
        for w, tree, nodes in zip(spec, drafted, chosen, strict=True):
            w.tree = tree.subtree(nodes) if nodes else None
        return max(j.depth for j in jobs)

    def _tree_budget(self, spec: list[_Work]) -> tuple[int, int, int]:
        """AdaServe's node budget for `spec` (their planned drafts), and the depth and width
        of their candidate trees."""
        assert self.adaserve is not None
        budget = sum(w.num_spec for w in spec)
        depth, width = self.adaserve.shape(budget, len(spec), max(w.num_spec for w in spec))
        return budget, depth, width

    def _select(
        self,
        works: list[_Work],
        spec: list[_Work],
        trees: list[TokenTree],
        budget: int,
        depth: int,
    ) -> list[list[int]]:
        """AdaServe's nodes for each of `spec`'s candidate trees, by the tokens each request
        must gain by the step's predicted end; the plan's own split when the trees' KV would
        not fit (that split always does: the plan passed the capacity check)."""
        assert self.adaserve is not None
        adaserve = self.adaserve
        shape = self._shape(works, [w.num_spec for w in works], adaserve.perf.tp)
        needs = adaserve.needs([(w.seq.request, len(w.seq.generated)) for w in spec], shape)

        def fits(chosen: list[list[int]]) -> bool:
            return self._tree_blocks(works, spec, chosen) <= self.cache.num_free_blocks

        return adaserve.choose(trees, needs, budget, [w.num_spec for w in spec], depth, fits)

    def _tree_depth_limit(self, w: _Work) -> int:
        """The deepest node a decode may verify: within max_tokens and the model's length."""
        seq = w.seq
        left = seq.request.sampling.max_tokens - len(seq.output) - 1
        return max(0, min(left, self.max_model_len - seq.num_known))

    def _tree_blocks(self, works: list[_Work], spec: list[_Work], chosen: list[list[int]]) -> int:
        """Target KV blocks the step takes with these trees (and those already grown) in
        place of the planned drafts."""
        nodes = {id(w): len(c) for w, c in zip(spec, chosen, strict=True)}

        def drafts(w: _Work) -> int:
            if id(w) in nodes:
                return nodes[id(w)]
            return w.num_spec if w.tree is None else len(w.tree) - 1

        return sum(
            self.cache.extra_blocks_needed(w.seq.request.request_id, w.num_feed + drafts(w))
            for w in works
        )

    def _propose_sampled_trees(self, works: list[_Work], spec: list[_Work]) -> int:
        """AdaServe for requests sampled without a seed: a tree's shape is chosen first (the
        selection over a beam of draw indexes, each with its learned chance), then the draft
        draws its tokens, each node's children independently from its distribution there, so
        that SpecInfer's rule verifies it losslessly (`verify_tree_sampled`). A seeded request
        keeps its chain, drawn with the noise its target draws use. Returns the levels the
        draft grew; 0 (nothing changed) when its cache cannot hold them."""
        assert self.adaserve is not None and self.draft is not None
        adaserve = self.adaserve
        budget, depth, width = self._tree_budget(spec)
        chances = adaserve.sampled.chances(width)
        templates = [
            template_tree(chances, min(depth, self._tree_depth_limit(w)), width) for w in spec
        ]
        chosen = self._select(works, spec, templates, budget, depth)
        shapes = [t.subtree(nodes) for t, nodes in zip(templates, chosen, strict=True)]
        growing = [(w, s) for w, s in zip(spec, shapes, strict=True) if len(s) > 1]
        draft_need = sum(
            self.draft.blocks_needed(
                w.seq.request.request_id,
                w.seq.num_known + sum(1 for n in range(1, len(s)) if s.children(n)),
            )
            for w, s in growing
        ) + self._draft_blocks(_others(works, spec))
        if not growing or draft_need > self.draft.cache.num_free_blocks:
            return 0
        jobs = [
            SampledTreeJob(
                w.seq.request.request_id,
                w.seq.tokens,
                s,
                w.seq.request.sampling,
                w.seq.generator,
                w.seq.shaper,
            )
            for w, s in growing
        ]
        for (w, _), (tree, draws) in zip(
            growing, self.draft.propose_sampled_trees(jobs), strict=True
        ):
            self.draft.rollback(w.seq.request.request_id, w.seq.num_known)
            w.tree, w.tree_draws = tree, draws
        return max(max(s.depths) for _, s in growing)

    def _shape(self, works: list[_Work], drafts: list[int], tp: int) -> BatchShape:
        """The step as the perf model sees it, each work drafting `drafts[i]` tokens."""
        plan = BatchPlan(
            tuple(
                w.entry if isinstance(w.entry, PrefillChunk) else DecodeStep(w.entry.request_id, d)
                for w, d in zip(works, drafts, strict=True)
            )
        )
        seqs = self._seqs
        return BatchShape.of_plan(plan, lambda rid: seqs[rid].num_computed, tp)

    def _draft_floors(self, works: list[_Work], spec: list[_Work]) -> list[float]:
        """Each drafting work's SpecServe floor (0: draft all it may)."""
        if self.specserve is None:
            return [0.0] * len(spec)
        shape = self._shape(works, [w.num_spec for w in works], self.specserve.perf.tp)
        return self.specserve.draft_floors(
            shape, [i for i, w in enumerate(works) if w.num_spec > 0]
        )

    def _calibration(self, w: _Work) -> ConfidenceCalibration | None:
        """SpecServe's calibration for the kind of drafts `w` makes (None without SpecServe)."""
        if self.specserve is None:
            return None
        greedy = w.seq.request.sampling.greedy
        return self.specserve.greedy if greedy else self.specserve.sampled

    def _trim_proposals(self, works: list[_Work]) -> None:
        """Send to verification only the drafts SpecServe keeps. An unseeded sampled request
        keeps all of its own: its drafts are judged against the draft's probability of the
        very token drawn, so dropping a draft for being unlikely would skew what it samples
        (greedy and seeded requests keep what the target itself chooses, whatever is cut)."""
        if self.specserve is None:
            return
        drafted = [len(w.proposal.tokens) for w in works]
        chances = {}
        for i, w in enumerate(works):
            calibration = self._calibration(w)
            if w.proposal.tokens and w.proposal.confidences and calibration is not None:
                chances[i] = calibration.chances(w.proposal.confidences)
        whole = {i for i in chances if works[i].proposal.probs is not None}
        decodes = sum(1 for w in works if not isinstance(w.entry, PrefillChunk))
        shape = self._shape(works, drafted, self.specserve.perf.tp)
        kept = self.specserve.verify_lengths(shape, chances, decodes, whole)
        for i, n in kept.items():
            works[i].proposal = works[i].proposal.trimmed(n)

    def _draft_prefill(self, works: list[_Work]) -> float:
        """Feed the draft model this step's prefill chunks; returns the seconds it took."""
        if self.draft is None:
            return 0.0
        chunks = [
            (w.seq.request.request_id, w.seq.tokens[: _draft_tokens(w)])
            for w in works
            if isinstance(w.entry, PrefillChunk)
        ]
        if not chunks:
            return 0.0
        start = time.perf_counter()
        cached = [self.draft.cache.num_tokens(rid) for rid, _ in chunks]
        try:
            self.draft.prefill(chunks)
            self._settle()
        except Exception:
            log.exception("the draft's prefill failed; its requests' drafts catch up later")
            for (rid, _), n in zip(chunks, cached, strict=True):
                self.draft.rollback(rid, n)
        return time.perf_counter() - start

    def _forward(self, works: list[_Work], seqs: list[ForwardSeq]) -> tuple[torch.Tensor, set[int]]:
        """The target's logits for `seqs`, and the indices of the sequences it could not run.
        A fault in the batched forward (a GPU out of memory at this batch's size, a kernel
        failing on one request's shape, reported when the GPU is waited for) is retried with
        each sequence alone, so that only the requests whose own forward fails lose their
        step: a sequence run again writes the same KV into the same slots. Not in a
        tensor-parallel group, whose other ranks may be waiting in the failed batch's
        collectives."""
        if not seqs:
            return torch.empty(0), set()
        try:
            return self._settled(seqs), set()
        except Exception:
            if self.target.tp is not None:
                raise
            log.exception(
                "the target's forward failed for %d requests; running each alone", len(seqs)
            )
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()
        parts = []
        failed = set()
        for i, (w, fs) in enumerate(zip(works, seqs, strict=True)):
            try:
                parts.append(self._settled([fs]))
            except Exception:
                log.exception(
                    "request %s: the target's forward fails for it alone; ending it as aborted",
                    w.seq.request.request_id,
                )
                failed.add(i)
        return (torch.cat(parts) if parts else torch.empty(0)), failed

    def _settled(self, seqs: list[ForwardSeq]) -> torch.Tensor:
        """The target's forward, waited for: a GPU fault surfaces here, not in a later call."""
        logits = self.target.forward(seqs)
        self._settle()
        return logits

    def _settle(self) -> None:
        """Wait for the GPU's queued kernels, so a timed part of the step counts its own work
        rather than the next part's (a no-op on CPU, where calls return when done)."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)

    def _forward_seq(self, w: _Work) -> ForwardSeq:
        seq = w.seq
        rid = seq.request.request_id
        cached = seq.num_computed
        if isinstance(w.entry, PrefillChunk):
            feed = seq.tokens[cached : cached + w.num_feed]
            num_logits = 1 if cached + w.num_feed == seq.num_known else 0
            w.prompt_rows = self._prompt_rows(seq, cached, w.num_feed)
            if w.prompt_rows is not None:
                num_logits = w.num_feed
        elif w.tree is not None:
            tree = w.tree
            self.cache.append(rid, len(tree))
            table = self.cache.block_table(rid)
            mask = torch.tensor(tree.attn_mask())
            return ForwardSeq(tree.tokens, table, cached, len(tree), tree.positions(cached), mask)
        else:
            feed = [seq.last_token, *w.proposal.tokens]
            num_logits = len(feed)
        self.cache.append(rid, len(feed))
        return ForwardSeq(feed, self.cache.block_table(rid), cached, num_logits=num_logits)

    def _finish_entry(self, w: _Work, logits: torch.Tensor, argmax: list[int]) -> RequestOutcome:
        seq = w.seq
        rid = seq.request.request_id
        params = seq.request.sampling
        proposal = w.proposal.tokens
        if w.prompt_rows is not None:
            first, last = w.prompt_rows
            cached, prompt = seq.num_computed, seq.request.prompt_token_ids
            values = logits[first - cached : last - cached + 1]
            k = params.prompt_logprobs
            seq.prompt_logprobs += token_logprobs(
                values, prompt[first + 1 : last + 2], k, ranked=True
            )
            final = cached + w.num_feed == seq.num_known
            logits, argmax = (logits[-1:], argmax[-1:]) if final else (logits[:0], [])
        if not argmax:
            seq.num_computed += w.num_feed
            self._register(seq)
            return RequestOutcome(rid, num_computed_tokens=seq.num_computed)
        raw = logits
        if w.tree is not None:
            return self._finish_tree(w, w.tree, logits, argmax)
        if seq.shaper is not None:
            logits = seq.shaper.shape(logits, proposal)
            argmax = logits.argmax(dim=-1).tolist()
        if params.greedy:
            new = verify_choices(proposal, argmax)
        elif params.seed is not None:
            noise = w.noise
            if noise is None:
                vocab = self.target.vocab_size
                noise = position_noise(params.seed, len(seq.tokens), logits.shape[0], vocab)
            new = verify_choices(proposal, noisy_choice(token_probs(logits, params), noise))
        elif proposal:
            probs = token_probs(logits, params)
            new = verify_stochastic(proposal, w.proposal.probs, probs, seq.generator)
        else:
            new = sample(token_probs(logits, params), seq.generator)
        accepted = len(new) - 1
        calibration = self._calibration(w)
        if calibration is not None and w.proposal.confidences:
            calibration.observe(w.proposal.confidences, accepted)
        # KV now holds every fed token; keep the context plus the accepted proposals.
        seq.num_computed = seq.num_computed + (w.num_feed if not proposal else 1 + accepted)
        self.cache.truncate(rid, seq.num_computed)
        if self.draft is not None and proposal:
            self.draft.rollback(rid, seq.num_computed)
        return self._outcome(seq, new, raw, len(proposal))

    def _finish_tree(
        self, w: _Work, tree: TokenTree, logits: torch.Tensor, argmax: list[int]
    ) -> RequestOutcome:
        """Verify a token tree (a greedy request's by the target's own choices, a sampled
        one's by SpecInfer's rule), move the accepted path's KV right after the context and
        drop the rest."""
        seq = w.seq
        raw = logits
        if seq.shaper is not None:
            shaper = seq.shaper
            paths = [tree.path_tokens(i) for i in range(len(tree))]
            logits = torch.cat(
                [shaper.shape(logits[i : i + 1], p, start=len(p)) for i, p in enumerate(paths)]
            )
            argmax = logits.argmax(dim=-1).tolist()
        assert self.adaserve is not None
        if w.tree_draws is None:
            accepted, new = verify_tree_choices(tree, argmax)
            self.adaserve.observe(tree, accepted)
        else:
            probs = token_probs(logits, seq.request.sampling)
            accepted, new = verify_tree_sampled(tree, probs, w.tree_draws, seq.generator)
            self.adaserve.sampled.observe(tree, accepted)
        rid = seq.request.request_id
        cached = seq.num_computed
        if any(node != j + 1 for j, node in enumerate(accepted)):
            src = [cached + node for node in accepted]
            dst = list(range(cached + 1, cached + 1 + len(accepted)))
            self.target.move_kv([KVMove(self.cache.block_table(rid), src, dst)])
        seq.num_computed = cached + 1 + len(accepted)
        self.cache.truncate(rid, seq.num_computed)
        judged = judged_nodes(tree, accepted)
        return self._outcome(seq, new, raw[[0, *accepted]], len(tree) - 1, judged)

    def _abort_entry(self, seq: _Seq, failed: str) -> RequestOutcome:
        """End a request whose own step work (`failed`) failed: its KV state is unknown, so
        it goes."""
        seq.finish_reason = FinishReason.ABORT
        self._free_kv(seq.request.request_id)
        return RequestOutcome(
            seq.request.request_id,
            num_computed_tokens=seq.num_computed,
            finish_reason=FinishReason.ABORT,
            abort_reason=f"the replica failed at {failed} for this request; its log says why",
        )

    def _outcome(
        self,
        seq: _Seq,
        new: list[int],
        rows: torch.Tensor,
        drafted: int,
        judged: int | None = None,
    ) -> RequestOutcome:
        """Append a decode's verified tokens (`rows`: the logits they came from, in order;
        `judged`: a tree's judged drafts)."""
        rid = seq.request.request_id
        params = seq.request.sampling
        appended = self._append(seq, new)
        self._register(seq)
        if seq.finish_reason is not None:
            self._free_kv(rid)
        return RequestOutcome(
            rid,
            new_token_ids=appended,
            num_computed_tokens=seq.num_computed,
            num_draft_tokens=drafted,
            num_accepted_tokens=len(new) - 1,
            num_judged_drafts=judged,
            finish_reason=seq.finish_reason,
            abort_reason=seq.abort_reason,
            logprobs=token_logprobs(rows, appended, params.logprobs),
            prompt_logprobs=seq.prompt_logprobs if len(seq.output) == len(appended) else [],
        )

    def _register(self, seq: _Seq) -> None:
        """Offer the request's computed tokens (verified: rejected drafts are rolled back by
        now) to later requests with the same prefix, in both models' caches: at every step,
        so the tokens are built only once a block has filled (and never without the cache)."""
        rid = seq.request.request_id
        caches = [(self.cache, seq.num_computed)]
        if self.draft is not None:
            drafted = min(self.draft.cache.num_tokens(rid), seq.num_computed)
            caches.append((self.draft.cache, drafted))
        due = [(cache, n) for cache, n in caches if cache.registrable(rid, n)]
        if due:
            tokens = seq.tokens
            for cache, n in due:
                cache.register(rid, tokens, n)

    def _prompt_rows(self, seq: _Seq, cached: int, num_feed: int) -> tuple[int, int] | None:
        """The positions (first, last) of a prefill chunk whose logits give prompt tokens'
        log-probabilities not computed yet (position p gives token p + 1's), or None: none
        asked, or already sent with the first token (a prefill after a preemption)."""
        if seq.request.sampling.prompt_logprobs is None or seq.output:
            return None
        first = max(cached, len(seq.prompt_logprobs))
        last = min(cached + num_feed - 1, seq.request.prompt_len - 2)
        return (first, last) if first <= last else None

    def _shaper(self, request: Request) -> LogitsShaper | None:
        params = request.sampling
        if not params.shapes_logits:
            return None
        held_back = set(params.stop_token_ids)
        if not params.ignore_eos:
            held_back |= self.eos_token_ids
        prompt, resumed = request.prompt_token_ids, request.resumed_output
        grammar = None
        if params.grammar is not None:
            assert self.grammar_vocab is not None
            grammar = Grammar(self.grammar_vocab, params.grammar, prompt[len(prompt) - resumed :])
        return LogitsShaper(
            params,
            prompt,
            resumed,
            held_back,
            self.target.vocab_size,
            self.target.device,
            min(self.eos_token_ids, default=0),  # a model without EOS: token 0
            grammar,
        )

    def _append(self, seq: _Seq, new: list[int]) -> list[int]:
        """Append tokens one by one until a stop condition; returns those appended."""
        params = seq.request.sampling
        before = len(seq.output)
        for token in new:
            seq.output.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
                if seq.grammar.broken:
                    why = seq.grammar.broken.splitlines()[0][:300]
                    log.warning(
                        "request %s: its grammar cannot go on (%s); ending it as aborted",
                        seq.request.request_id,
                        why,
                    )
                    seq.finish_reason = FinishReason.ABORT
                    seq.abort_reason = f"the output can no longer follow its grammar: {why}"
                    break
            if self._stops_at(seq, token):
                seq.finish_reason = FinishReason.STOP
                break
            if len(seq.output) >= params.max_tokens:
                seq.finish_reason = FinishReason.LENGTH
                break
        appended = seq.output[before:]
        if seq.shaper is not None:
            seq.shaper.add(appended)
        return appended

    def _stops_at(self, seq: _Seq, token: int) -> bool:
        """Whether the token just appended ends the output: EOS, a stop token id, a complete
        grammar, or a stop string ending in its text; as vLLM v1, no stop string ends in the
        first min_tokens tokens (EOS and stop ids cannot be drawn there; a complete grammar
        allows nothing else)."""
        params = seq.request.sampling
        if token in self.eos_token_ids and not params.ignore_eos:
            return True
        if seq.grammar is not None and seq.grammar.done:
            return True
        if token in params.stop_token_ids:
            return True
        return (
            bool(params.stop)
            and len(seq.output) > params.min_tokens
            and self._completes_a_stop(seq)
        )

    def _completes_a_stop(self, seq: _Seq) -> bool:
        """Whether the token just appended completes a stop string in the output text: only
        the text of the last few tokens is decoded (a character may take several byte-level
        tokens), counting a resumed request's earlier output. The token stays in the output,
        as in vLLM; the text the client sees is cut before the stop string by the front door
        (router.stops).

        When every earlier token in the window was checked here, any match ends in this token.
        Otherwise (tokens min_tokens exempted, or output from before a resume, which may have
        been exempt there) a match must end in this token's text, which costs a second
        decode."""
        assert self.detokenize is not None
        params = seq.request.sampling
        window = 4 * max(len(s) for s in params.stop) + 8
        all_checked = not params.min_tokens and not seq.request.resumed_output
        only_last = not all_checked and len(seq.output) - window < params.min_tokens
        return ends_a_stop(self.detokenize, seq.generated[-window:], params.stop, only_last)


def ends_a_stop(
    detokenize: Detokenize, recent: list[int], stops: tuple[str, ...], only_last: bool
) -> bool:
    """Whether the text of `recent` holds a stop string (`only_last`: one that ends in its
    last token's text, past the longest common prefix with the text without that token,
    since a character the token completes decoded as U+FFFD there). Only whole characters
    count: the pieces the window cuts at its start, or the last token leaves unfinished,
    decode as U+FFFD, which the client never sees (router.tokenizer holds text back until
    its character is whole), so a stop string holding one must not match them."""
    text = _whole(detokenize(recent))
    if not only_last:
        return any(s in text for s in stops)
    before = _common_prefix(_whole(detokenize(recent[:-1])), text)
    return any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in stops)


def _whole(text: str) -> str:
    """The text without the pieces of characters at its ends."""
    return text.strip(REPLACEMENT_CHAR)


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], k: int | None, *, ranked: bool = False
) -> list[TokenLogprob]:
    """Token i came from row i of its entry's logits (the verified positions, in order). Only
    the chosen and top-k values (and with `ranked`, the chosen token's rank) leave the device,
    never a vocabulary-wide row."""
    if k is None or not tokens:
        return []
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    index = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen_rows = logprobs.gather(1, index)
    chosen = chosen_rows.squeeze(1).tolist()
    ranks: list[int | None] = [None] * len(tokens)
    if ranked:
        ranks = ((logprobs > chosen_rows).sum(dim=1) + 1).tolist()
    if k == 0:
        return [TokenLogprob(lp, (), rank) for lp, rank in zip(chosen, ranks, strict=True)]
    values, ids = logprobs.topk(k, dim=-1)
    tops = zip(ids.tolist(), values.tolist(), ranks, strict=True)
    return [
        TokenLogprob(lp, tuple(zip(top_ids, top_values, strict=True)), rank)
        for lp, (top_ids, top_values, rank) in zip(chosen, tops, strict=True)
    ]


def _others(works: list[_Work], some: list[_Work]) -> list[_Work]:
    """The works not among `some` (by identity: a work's fields may compare equal)."""
    ids = {id(w) for w in some}
    return [w for w in works if id(w) not in ids]


def _draft_tokens(w: _Work) -> int:
    """Tokens the draft caches for a plan entry: a prefill chunk's end, or a k-token
    proposal's known tokens + k - 1."""
    if isinstance(w.entry, PrefillChunk):
        return w.seq.num_computed + w.num_feed
    return w.seq.num_known + w.num_spec - 1


def detokenizer(tokenizer: Tokenizer) -> Detokenize:
    """A tokenizer's decode function, as stop strings read the output."""

    def detokenize(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return detokenize
