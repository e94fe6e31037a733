"""Draft-model proposals with the draft's own paged KV cache.

The draft prefills each prompt chunk in the step that prefills the target (`prefill`). A
proposal's first forward feeds every known token the draft has not seen yet (the tokens
accepted or corrected since its last proposal), then k - 1 one-token steps; for greedy
requests in decode-size rows all k steps run in one C call (`ModelRunner.greedy_chain`). After
verification the engine rolls the draft cache back to the tokens that were accepted, so the
draft never holds a rejected token. For SpecServe (replica.planner.specserve) each proposed
token carries the draft's confidence in it (its probability under the distribution it was
chosen from), and a job with a floor stops early once its next token would likely be refused,
in the C chain as in the Python loop.

A draft checkpoint may ship `draft_vocab.json`: its LM head is then cut to those tokens (the
corpus's most frequent ones, as FR-Spec does), since at batch 1 the head is a large share of
a draft step's weight bytes. Proposals stay lossless: greedy drafts are checked against the
target's argmax, and stochastic ones carry q spread over the whole vocabulary with zeros off
the cut, which is exactly what the acceptance rule min(1, p/q) and the residual need.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.kv_cache import KVCacheManager
from replica.model_runner import ForwardSeq, ModelRunner
from replica.planner.adaserve import TreeCalibration
from replica.planner.specserve import ConfidenceCalibration, keeps_drafting
from replica.request import SamplingParams
from replica.sampling import LogitsShaper, noisy_choice, sample, token_probs
from replica.spec.tree import TokenTree, level_slots

DRAFT_VOCAB_FILE = "draft_vocab.json"


def load_draft_vocab(draft_dir: str | Path) -> list[int] | None:
    """The token ids a draft checkpoint's head is cut to (`draft_vocab.json` beside its weights,
    {"token_ids": [...]}), or None when it ships no such file and keeps its whole head."""
    path = Path(draft_dir) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    ids = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{path}: token_ids must be a list of integers")
    return ids


@dataclass
class DraftJob:
    """One request's proposal task in a batched draft run."""

    request_id: str
    tokens: list[int]
    """All known tokens (prompt + output)."""
    k: int
    params: SamplingParams
    generator: torch.Generator
    noise: torch.Tensor | None = None
    """A seeded request's noise [k, vocab] of the positions it proposes (replica.sampling):
    its draft tokens are drawn with the noise the target's own draws will use."""
    shaper: LogitsShaper | None = None
    """The request's grammar, bias, penalties, bad words and min_tokens: the draft proposes
    from logits shaped as the target's will be, which keeps its proposals acceptable."""
    calibration: ConfidenceCalibration | None = None
    """SpecServe's (replica.planner.specserve) for this kind of draft: each token then carries
    the draft's confidence in it, and the job stops before k once its next token's predicted
    acceptance (the product of the chances this gives its tokens so far times the last one)
    falls below `floor`. None: no confidences, all k tokens."""
    floor: float = 0.0


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None
    """Draft distributions [k, vocab] the tokens were sampled from; None where verification
    needs none (greedy and seeded requests: they keep what the target itself chooses)."""
    confidences: list[float] | None = None
    """The draft's probability of each token it proposed (None: a proposer without one)."""

    def trimmed(self, kept: int) -> Proposal:
        """The proposal's first `kept` tokens."""
        probs = None if self.probs is None else self.probs[:kept]
        confidences = None if self.confidences is None else self.confidences[:kept]
        return Proposal(self.tokens[:kept], probs, confidences)


@dataclass
class TreeJob:
    """One greedy request's candidate tree in a batched beam search (AdaServe,
    replica.spec.tree)."""

    request_id: str
    tokens: list[int]
    """All known tokens (prompt + output); the last is the tree's root."""
    depth: int
    shaper: LogitsShaper | None = None


@dataclass
class SampledTreeJob:
    """One sampled request's tree (AdaServe, replica.spec.tree): a shape chosen before its
    tokens are drawn."""

    request_id: str
    tokens: list[int]
    """All known tokens (prompt + output); the last is the tree's root."""
    shape: TokenTree
    params: SamplingParams
    generator: torch.Generator
    shaper: LogitsShaper | None = None


@dataclass
class _Growing:
    """One request's tree as the draft feeds it, level by level."""

    request_id: str
    tree: TokenTree
    context: int
    """Its known tokens, the last the tree's root."""
    feed: list[int]
    """The known tokens the draft cache lacks, fed with the root's level."""
    slots: dict[int, int]
    """Each fed node's slot in the draft cache (the root's: its context position)."""


class DraftModel:
    """A `ModelRunner` plus its block tables; proposes k tokens per request, k may differ."""

    def __init__(self, runner: ModelRunner, prefix_caching: bool = False) -> None:
        self.runner = runner
        vocab = runner.head_vocab
        self._vocab_cpu = None if vocab is None else vocab.cpu()
        """The cut head's token ids where sampled distributions live (the CPU, see
        sampling.token_probs), copied once rather than at every sampled draft token."""
        self.cache = KVCacheManager(runner.num_blocks, prefix_caching=prefix_caching)

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks caching `num_tokens` of the request takes (a k-token proposal caches
        its known tokens + k - 1, a prefill the chunk's end)."""
        cached = self.cache.num_tokens(request_id)
        return self.cache.extra_blocks_needed(request_id, max(0, num_tokens - cached))

    def prefill(self, chunks: list[tuple[str, list[int]]]) -> None:
        """Cache each request's known tokens up to the end of its prefill chunk, in the step
        that prefills the target: the first proposal then starts from a warm cache instead of
        putting the whole prompt's draft forward into a decode step no planner predicted."""
        seqs = []
        for request_id, tokens in chunks:
            cached = self.cache.num_tokens(request_id)
            if cached >= len(tokens):
                continue
            self.cache.append(request_id, len(tokens) - cached)
            seqs.append(ForwardSeq(tokens[cached:], self.cache.block_table(request_id), cached, 0))
        if seqs:
            self.runner.forward(seqs)

    def propose(self, jobs: list[DraftJob]) -> list[Proposal]:
        """At most max(k) batched draft forwards; a request leaves the batch once it has k
        tokens, or with a calibration once its next one falls below its floor. Batches of
        greedy requests without logits shaping, in decode-size rows, run every step in one C
        call. (Splitting a mixed batch into the chain and the rest was tried: no faster, since
        both parts read all the weights at every step.)"""
        pending: list[list[int]] = []
        for job in jobs:
            cached = self.cache.num_tokens(job.request_id)
            pending.append(job.tokens[cached:])
        plain_greedy = all(j.params.greedy and j.shaper is None for j in jobs)
        if plain_greedy and self.runner.can_chain([len(p) for p in pending]):
            return self._propose_chain(jobs, pending)
        confidences: list[list[float]] = [[] for _ in jobs]
        proposals = [
            Proposal([], None, c if j.calibration else None)
            for j, c in zip(jobs, confidences, strict=True)
        ]
        prob_rows: list[list[torch.Tensor]] = [[] for _ in jobs]
        for step in range(max((j.k for j in jobs), default=0)):
            active = [
                i
                for i, j in enumerate(jobs)
                if j.k > step
                and len(proposals[i].tokens) == step
                and (
                    j.calibration is None
                    or keeps_drafting(j.calibration.chances(confidences[i]), j.floor)
                )
            ]
            if not active:
                break
            seqs = []
            for i in active:
                rid = jobs[i].request_id
                cached = self.cache.num_tokens(rid)
                self.cache.append(rid, len(pending[i]))
                seqs.append(
                    ForwardSeq(pending[i], self.cache.block_table(rid), cached, num_logits=1)
                )
            logits = self.runner.forward(seqs)
            greedy_choice = self.runner.token_ids(logits.argmax(dim=-1)).tolist()
            for row, i in enumerate(active):
                job = jobs[i]
                params = job.params
                confident = job.calibration is not None
                if params.greedy and job.shaper is None:
                    token = greedy_choice[row]
                    if confident:
                        confidences[i].append(float(logits[row].float().softmax(dim=-1).max()))
                elif params.greedy:
                    assert job.shaper is not None
                    shaped = self._shaped(logits[row : row + 1], job.shaper, proposals[i].tokens)
                    token = int(shaped.argmax())
                    if confident:
                        confidences[i].append(float(shaped.float().softmax(dim=-1)[0, token]))
                else:
                    probs = self._probs(
                        logits[row : row + 1], job.params, job.shaper, proposals[i].tokens
                    )
                    if job.noise is not None:
                        token = noisy_choice(probs, job.noise[step : step + 1])[0]
                    else:
                        token = sample(probs, job.generator)[0]
                        prob_rows[i].append(probs[0])
                    if confident:
                        confidences[i].append(float(probs[0, token]))
                proposals[i].tokens.append(token)
                pending[i] = [token]
        for i, rows in enumerate(prob_rows):
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals

    def propose_trees(
        self, jobs: list[TreeJob], width: int, calibration: TreeCalibration
    ) -> list[TokenTree]:
        """Beam search: each level keeps a request's `width` children of highest path score
        (the product of the chances along the path, `calibration`'s: the chance the target
        accepts a child, from its rank among the draft's choices and the draft's probability
        of it; over all parents, not per parent), down to its `depth`. A level is one
        batched forward of the previous level's nodes, each seeing the context and its own
        ancestors only (a mask over the levels already cached), so the draft runs as many
        forwards as a chain of the same depth. The cache keeps the levels until `rollback`.
        Requests that shape nothing grow every level in one C call (`ModelRunner.greedy_tree`)
        when the fused forward takes them."""
        for job in jobs:
            self.rollback(job.request_id, len(job.tokens) - 1)
        fused = self._propose_trees_fused(jobs, width, calibration)
        if fused is not None:
            return fused
        growing = [self._start(j.request_id, j.tokens, TokenTree.root(j.tokens[-1])) for j in jobs]
        scores: list[list[float]] = [[1.0] for _ in jobs]
        levels: list[list[int]] = [[0] for _ in jobs]
        for level in range(max((j.depth for j in jobs), default=0)):
            for i in range(len(jobs)):
                if jobs[i].depth <= level:
                    levels[i] = []
            if not any(levels):
                break
            rows = iter(self._feed_level(growing, levels))
            for i, parents in enumerate(levels):
                if parents:
                    tree = growing[i].tree
                    grown = self._grow(
                        jobs[i], width, calibration, tree, scores[i], parents, next(rows)
                    )
                    levels[i] = grown
        return [g.tree for g in growing]

    def propose_sampled_trees(
        self, jobs: list[SampledTreeJob]
    ) -> list[tuple[TokenTree, dict[int, torch.Tensor]]]:
        """Fill each job's tree shape with tokens drawn from the draft: level by level, every
        node with children is fed (seeing the context and its ancestors), and its children's
        tokens are drawn independently from the distribution there (shaped after the node's
        path), which verification needs (`replica.spec.verify.verify_tree_sampled`). Returns
        each tree and those distributions, by parent node. The cache keeps the levels until
        `rollback`."""
        for job in jobs:
            self.rollback(job.request_id, len(job.tokens) - 1)
        growing = []
        for job in jobs:
            tree = copy.deepcopy(job.shape)
            tree.tokens[0] = job.tokens[-1]
            growing.append(self._start(job.request_id, job.tokens, tree))
        drawn: list[dict[int, torch.Tensor]] = [{} for _ in jobs]
        depths = [g.tree.depths for g in growing]
        for level in range(max((max(d) for d in depths), default=0)):
            fed = [
                [n for n, at in enumerate(d) if at == level and g.tree.children(n)]
                for g, d in zip(growing, depths, strict=True)
            ]
            if not any(fed):
                break
            rows = iter(self._feed_level(growing, fed))
            for job, g, draws, nodes in zip(jobs, growing, drawn, fed, strict=True):
                logits = next(rows) if nodes else None
                for row, node in enumerate(nodes):
                    assert logits is not None
                    path = g.tree.path_tokens(node)
                    q = self._probs(logits[row : row + 1], job.params, job.shaper, path)[0]
                    children = g.tree.children(node)
                    tokens = torch.multinomial(q, len(children), True, generator=job.generator)
                    for child, token in zip(children, tokens.tolist(), strict=True):
                        g.tree.tokens[child] = int(token)
                    draws[node] = q
        return [(g.tree, draws) for g, draws in zip(growing, drawn, strict=True)]

    def _propose_trees_fused(
        self, jobs: list[TreeJob], width: int, calibration: TreeCalibration
    ) -> list[TokenTree] | None:
        """The trees from one C call, or None when the C beam cannot grow them."""
        if not jobs or any(j.shaper is not None for j in jobs):
            return None
        feeds = [j.tokens[self.cache.num_tokens(j.request_id) :] for j in jobs]
        depth = max(j.depth for j in jobs)
        if not self.runner.can_tree([len(f) for f in feeds], depth, width):
            return None
        seqs = []
        for job, feed in zip(jobs, feeds, strict=True):
            rid = job.request_id
            cached = self.cache.num_tokens(rid)
            self.cache.append(rid, len(feed) + level_slots(job.depth, width))
            seqs.append(ForwardSeq(feed, self.cache.block_table(rid), cached, num_logits=1))
        grown = self.runner.greedy_tree(seqs, [j.depth for j in jobs], width, calibration.tables())
        return [TokenTree(*tree) for tree in grown]

    def _start(self, request_id: str, known: list[int], tree: TokenTree) -> _Growing:
        """A tree to grow below the request's known tokens, from the draft cache's state."""
        cached = self.cache.num_tokens(request_id)
        return _Growing(request_id, tree, len(known), known[cached:], {0: len(known) - 1})

    def _feed_level(self, growing: list[_Growing], nodes: list[list[int]]) -> list[torch.Tensor]:
        """One batched forward of each tree's `nodes` (none: the tree sits this level out):
        the logits of each tree that fed nodes, in order, a row per node."""
        active = [(g, n) for g, n in zip(growing, nodes, strict=True) if n]
        logits = self.runner.forward([self._level_seq(g, n) for g, n in active])
        out, row = [], 0
        for _, fed in active:
            out.append(logits[row : row + len(fed)])
            row += len(fed)
        return out

    def _level_seq(self, growing: _Growing, nodes: list[int]) -> ForwardSeq:
        """The forward of one tree level: the uncached known tokens and the root first, then
        each level's nodes, each seeing the context, its cached ancestors and itself."""
        rid, tree, slots = growing.request_id, growing.tree, growing.slots
        cached = self.cache.num_tokens(rid)
        if nodes == [0]:
            self.cache.append(rid, len(growing.feed))
            return ForwardSeq(growing.feed, self.cache.block_table(rid), cached, num_logits=1)
        self.cache.append(rid, len(nodes))
        context = growing.context
        depths = tree.depths
        mask = torch.zeros(len(nodes), cached + len(nodes), dtype=torch.bool)
        mask[:, :context] = True
        for row, node in enumerate(nodes):
            slots[node] = cached + row
            for ancestor in tree.path(node):
                mask[row, slots[ancestor]] = True
        return ForwardSeq(
            [tree.tokens[n] for n in nodes],
            self.cache.block_table(rid),
            cached,
            num_logits=len(nodes),
            positions=[context - 1 + depths[n] for n in nodes],
            attn_mask=mask,
        )

    def _grow(
        self,
        job: TreeJob,
        width: int,
        calibration: TreeCalibration,
        tree: TokenTree,
        scores: list[float],
        parents: list[int],
        logits: torch.Tensor,
    ) -> list[int]:
        """Add the level below `parents`: the `width` children of highest path score (the
        product of the calibrated chances along the path); the tree keeps the draft's path
        probabilities and each child's rank among the draft's choices."""
        values, tokens = self._children(job, width, tree, parents, logits)
        candidates: list[tuple[float, float, int, int, int]] = []
        for parent, row_values, row_tokens in zip(parents, values, tokens, strict=True):
            for rank, (q, token) in enumerate(zip(row_values, row_tokens, strict=True)):
                if q > 0.0:
                    score = scores[parent] * calibration.chance(rank, q)
                    f = min(1.0, tree.probs[parent] * q)
                    candidates.append((score, f, parent, token, rank))
        candidates.sort(key=lambda c: -c[0])
        kept = []
        for score, f, parent, token, rank in candidates[:width]:
            kept.append(tree.add(parent, token, f, rank))
            scores.append(score)
        return kept

    def _children(
        self, job: TreeJob, width: int, tree: TokenTree, parents: list[int], logits: torch.Tensor
    ) -> tuple[list[list[float]], list[list[int]]]:
        """Each parent's `width` likeliest children (the draft's softmax probabilities, token
        ids) from the parent's row shaped as the target's row after its path will be (one
        batched softmax and top-k for a request that shapes nothing)."""
        width = min(width, logits.shape[-1])
        if job.shaper is None:
            values, columns = logits.float().softmax(dim=-1).topk(width)
            return values.tolist(), self.runner.token_ids(columns).tolist()
        rows = [
            self._shaped(logits[r : r + 1], job.shaper, path).softmax(dim=-1)[0].topk(width)
            for r, path in enumerate(tree.path_tokens(p) for p in parents)
        ]
        return [v.tolist() for v, _ in rows], [t.tolist() for _, t in rows]

    def _propose_chain(self, jobs: list[DraftJob], pending: list[list[int]]) -> list[Proposal]:
        """Every job is greedy: they share one calibration, or all have none."""
        seqs = []
        for job, feed in zip(jobs, pending, strict=True):
            cached = self.cache.num_tokens(job.request_id)
            self.cache.append(job.request_id, len(feed) + job.k - 1)
            seqs.append(ForwardSeq(feed, self.cache.block_table(job.request_id), cached, 1))
        calibration = jobs[0].calibration
        confident = calibration is not None
        floors = [j.floor for j in jobs] if confident else None
        table = None if calibration is None else calibration.table()
        chains = self.runner.greedy_chain(seqs, [j.k for j in jobs], confident, floors, table)
        proposals = []
        for job, seq, (tokens, confidences) in zip(jobs, seqs, chains, strict=True):
            # A chain stopped early wrote fewer tokens than were reserved.
            written = seq.num_cached + len(seq.token_ids) + len(tokens) - 1
            self.cache.truncate(job.request_id, written)
            proposals.append(Proposal(tokens, None, confidences))
        return proposals

    def _probs(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        shaper: LogitsShaper | None,
        drafted: list[int],
    ) -> torch.Tensor:
        """The distribution a draft token is drawn from, over the whole vocabulary (zero off
        a cut head)."""
        if shaper is None:
            return self._full_vocab(token_probs(logits, params))
        return token_probs(self._shaped(logits, shaper, drafted), params)

    def _shaped(
        self, logits: torch.Tensor, shaper: LogitsShaper, drafted: list[int]
    ) -> torch.Tensor:
        """Logits over the whole vocabulary (-inf off a cut head) shaped as the request's are,
        as if the tokens drafted so far were output."""
        return shaper.shape(self._full_logits(logits), drafted, start=len(drafted))

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary (-inf off a cut head)."""
        full = logits.float()
        vocab = self.runner.head_vocab
        if vocab is not None:
            full = full.new_full((full.shape[0], self.runner.vocab_size), float("-inf"))
            full[:, vocab] = logits.float()
        return full

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """A cut head's distribution spread over the whole vocabulary (zero off the cut), so
        verification sees the q it must divide by."""
        if self._vocab_cpu is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.runner.vocab_size)
        return full.index_copy_(1, self._vocab_cpu, probs)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep at most `num_tokens` cached tokens (those verified as the request's own)."""
        self.cache.truncate(request_id, min(num_tokens, self.cache.num_tokens(request_id)))

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
