"""Draft-model proposals with the draft's own paged KV cache.

The draft catches up lazily: its first forward of a step feeds every known token it has not
seen yet (the prompt on a request's first speculative step, afterwards the tokens accepted or
corrected since), then k - 1 one-token steps. After verification the engine rolls the draft
cache back to the tokens that were accepted, so the draft never holds a rejected token.

A draft checkpoint may ship `draft_vocab.json`: its LM head is then cut to those tokens (the
corpus's most frequent ones, as FR-Spec does), since at batch 1 the head is a large share of
a draft step's weight bytes. Proposals stay lossless: greedy drafts are checked against the
target's argmax, and stochastic ones carry q spread over the whole vocabulary with zeros off
the cut, which is exactly what the acceptance rule min(1, p/q) and the residual need.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.kv_cache import KVCacheManager
from replica.model_runner import ForwardSeq, ModelRunner
from replica.request import SamplingParams
from replica.sampling import sample, token_probs

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


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None
    """Draft distributions [k, vocab] the tokens were sampled from; None for greedy requests."""


class DraftModel:
    """A `ModelRunner` plus its block tables; proposes k tokens per request, k may differ."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = KVCacheManager(runner.num_blocks)

    def blocks_needed(self, request_id: str, num_known: int, k: int) -> int:
        """Extra blocks a k-token proposal takes: the draft caches num_known + k - 1 tokens."""
        cached = self.cache.num_tokens(request_id)
        return self.cache.extra_blocks_needed(request_id, num_known + k - 1 - cached)

    def propose(self, jobs: list[DraftJob]) -> list[Proposal]:
        """max(k) batched draft forwards; a request leaves the batch once it has k tokens."""
        proposals = [Proposal(tokens=[], probs=None) for _ in jobs]
        prob_rows: list[list[torch.Tensor]] = [[] for _ in jobs]
        pending: list[list[int]] = []
        for job in jobs:
            cached = self.cache.num_tokens(job.request_id)
            pending.append(job.tokens[cached:])
        for step in range(max((j.k for j in jobs), default=0)):
            active = [i for i, j in enumerate(jobs) if j.k > step]
            seqs = []
            for i in active:
                rid = jobs[i].request_id
                cached = self.cache.num_tokens(rid)
                self.cache.append(rid, len(pending[i]))
                seqs.append(
                    ForwardSeq(pending[i], self.cache.block_table(rid), cached, num_logits=1)
                )
            logits = self.runner.forward(seqs)
            greedy_choice = self._token_ids(logits.argmax(dim=-1)).tolist()
            for row, i in enumerate(active):
                job = jobs[i]
                if job.params.greedy:
                    token = greedy_choice[row]
                else:
                    probs = self._full_vocab(token_probs(logits[row : row + 1], job.params))
                    token = sample(probs, job.generator)[0]
                    prob_rows[i].append(probs[0])
                proposals[i].tokens.append(token)
                pending[i] = [token]
        for i, rows in enumerate(prob_rows):
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals

    def _token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        vocab = self.runner.head_vocab
        return columns if vocab is None else vocab[columns]

    def _full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """A cut head's distribution spread over the whole vocabulary (zero off the cut), so
        verification sees the q it must divide by."""
        vocab = self.runner.head_vocab
        if vocab is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.runner.vocab_size)
        return full.index_copy_(1, vocab, probs)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Keep at most `num_tokens` cached tokens (those verified as the request's own)."""
        self.cache.truncate(request_id, min(num_tokens, self.cache.num_tokens(request_id)))

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
