"""Token sampling: greedy, temperature, top-k, min-p, top-p; seeded requests draw by position.

`token_probs` is the single place a request's sampling parameters shape a distribution, so
ordinary sampling, draft proposals and speculative verification all use the same one (the
lossless acceptance rule needs p and q to be the distributions actually sampled from).

A request without a seed draws from its own generator, and speculative steps use the rejection
rule, which accepts the most drafts. A seeded request's token at sequence position n is
argmax(p / E_n), with E_n exponential noise fixed by (seed, n): an exact draw from p (the
exponential race) that does not depend on how the engine got there. The draft proposes with the
same noise and a proposal is kept only where it equals the target's own choice, so the output
is the same whatever the batching, the speculation lengths, a preemption or a move to another
replica.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from replica.grammar import Grammar
from replica.request import MAX_BAD_WORD_TOKENS, SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_POSITION_MIX = 0xBF58476D1CE4E5B9
"""Odd 64-bit multipliers spreading (seed, position) over the generator's seeds."""


def make_generator() -> torch.Generator:
    """A CPU generator seeded from OS entropy: an unseeded request's own."""
    gen = torch.Generator()
    gen.seed()
    return gen


def position_noise(seed: int, first: int, count: int, vocab: int) -> torch.Tensor:
    """Exponential(1) noise [count, vocab] of a seeded request at sequence positions first,
    first + 1, ...: -log U with U uniform in [0, 1) in float32 (as torch.multinomial draws),
    so never 0 and a zero-probability token never wins. 4-5x cheaper than exponential_ at a
    128k vocabulary; made once per position a step may sample, for the draft and
    verification."""
    noise = torch.empty(count, vocab)
    generator = torch.Generator()
    key = _fold_seed(seed)
    for row, position in enumerate(range(first, first + count)):
        generator.manual_seed((key * _SEED_MIX + position * _POSITION_MIX) % 2**64)
        torch.rand(vocab, generator=generator, out=noise[row])
    return noise.log_().neg_()


def _fold_seed(seed: int) -> int:
    """The seed's 64 bits in the low 32, all torch's CPU generator keeps of what it is seeded
    with: seeds 2^32 apart drew the same noise. A seed in [0, 2^32) is itself."""
    bits = seed % 2**64
    return (bits ^ (bits >> 32) * _SEED_MIX) % 2**32


def noisy_choice(probs: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """One token per row of `probs` [n, vocab]: argmax p / E with the row's noise."""
    return (probs / noise).argmax(dim=-1).tolist()


class LogitsShaper:
    """One request's grammar, logit bias, penalties and min_tokens, with what they count (the
    output's token counts, the tokens seen in prompt and output) kept as dense vocabulary
    tensors and updated as tokens are appended, so shaping a step costs a few tensor operations
    whatever the request's length.

    A row these leave without any token (say allowed_token_ids all held back by min_tokens,
    or outside the grammar) allows `end_token` (EOS) alone rather than failing the step on a
    distribution with nothing in it: the output ends there (unless it ignores EOS; a grammar
    that refuses EOS ends it as aborted, `replica.engine`).

    Row i of the logits a call shapes follows the request's tokens plus the first
    `start + i` proposed ones: a verify step's rows are shaped as decoding its proposal one by
    one would shape them, and a draft's k-th proposal as if the k - 1 before it were output.
    """

    def __init__(
        self,
        params: SamplingParams,
        tokens: Sequence[int],
        num_output: int,
        held_back: Collection[int],
        vocab: int,
        device: torch.device,
        end_token: int,
        grammar: Grammar | None = None,
    ) -> None:
        """`tokens`: prompt then output, whose last `num_output` are output (a resumed
        request's earlier output included: penalties count it). `held_back`: the tokens
        min_tokens keeps from being drawn (stop_token_ids, and EOS unless ignored). `grammar`:
        the request's structured output, kept in step with the output by the engine."""
        self.params = params
        self.vocab = vocab
        self.device = device
        self.grammar = grammar
        self.end_token = end_token
        self.num_fresh = 0
        """Output tokens appended here: min_tokens counts these (a resume lowers it)."""
        self.counts: torch.Tensor | None = None
        if params.presence_penalty or params.frequency_penalty:
            output = tokens[len(tokens) - num_output :]
            self.counts = torch.bincount(self._ids(output), minlength=vocab).float()
        self.seen: torch.Tensor | None = None
        """1.0 where prompt or output holds the token, else 0.0."""
        if params.repetition_penalty != 1.0:
            self.seen = torch.bincount(self._ids(tokens), minlength=vocab).clamp_(max=1).float()
        self.banned: torch.Tensor | None = None
        """True for every token outside allowed_token_ids, when the request names them."""
        if params.allowed_token_ids:
            self.banned = torch.ones(vocab, dtype=torch.bool, device=device)
            self.banned[self._ids(params.allowed_token_ids)] = False
        recent = max(len(tokens) - num_output, len(tokens) - MAX_BAD_WORD_TOKENS)
        self.output = list(tokens[recent:]) if params.bad_words else []
        """The output's last tokens, which bad words end in (kept when the request has some)."""
        self.bias_ids = self._ids([t for t, _ in params.logit_bias])
        self.bias = torch.tensor([b for _, b in params.logit_bias], device=device)
        self.held_back = self._ids(sorted(held_back) if params.min_tokens else [])

    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(tokens), dtype=torch.long, device=self.device)

    def add(self, tokens: Sequence[int]) -> None:
        """Count newly appended output tokens."""
        self.num_fresh += len(tokens)
        if not tokens:
            return
        if self.params.bad_words:
            self.output = (self.output + list(tokens))[-MAX_BAD_WORD_TOKENS:]
        ids = self._ids(tokens)
        if self.counts is not None:
            self.counts.index_add_(0, ids, torch.ones(len(tokens), device=self.device))
        if self.seen is not None:
            self.seen[ids] = 1.0

    def shape(
        self, logits: torch.Tensor, proposal: Sequence[int] = (), start: int = 0
    ) -> torch.Tensor:
        """Shaped fp32 copy of logits [n, vocab] (rows follow proposal[: start + i]), in
        vLLM's order: the grammar, allowed_token_ids, min_tokens and logit_bias, then the
        penalties."""
        out = self._shape(logits, proposal, start)
        if self.grammar is None and self.banned is None:
            return out  # bias, penalties and bad_words keep logits finite; min_tokens a few
        dead = torch.isneginf(out).all(dim=-1)
        if bool(dead.any()):
            out[dead] = float("-inf")
            out[dead, self.end_token] = 0.0
        return out

    def _shape(self, logits: torch.Tensor, proposal: Sequence[int], start: int) -> torch.Tensor:
        params = self.params
        n = logits.shape[0]
        out = logits.float().clone()
        if self.grammar is not None:
            out.masked_fill_(self.grammar.banned(proposal, start, n).to(out.device), float("-inf"))
        if self.banned is not None:
            out.masked_fill_(self.banned, float("-inf"))
        for i, row in enumerate(self._bad_words(proposal, start, n)):
            out[i, row] = float("-inf")
        masked = max(0, min(n, params.min_tokens - self.num_fresh - start))
        if masked and len(self.held_back):
            out[:masked, self.held_back] = float("-inf")
        if len(self.bias_ids):
            out[:, self.bias_ids] += self.bias
        if self.counts is None and self.seen is None:
            return out
        drafted = self._drafted(proposal[: start + n - 1], start, n)
        if self.seen is not None:
            seen = self.seen if drafted is None else (self.seen + drafted).clamp_(max=1.0)
            # x / r where x > 0, x * r elsewhere, on seen tokens only: x * r^-sign(x). (An
            # exponent rather than torch.where, which costs 5x more here; -inf stays -inf.)
            factor = torch.sign(out).mul_(seen).mul_(-math.log(params.repetition_penalty))
            out.mul_(factor.exp_())
        if self.counts is not None:
            counts = self.counts if drafted is None else self.counts + drafted
            out -= params.frequency_penalty * counts + params.presence_penalty * counts.clamp(
                max=1.0
            )
        return out

    def _bad_words(self, proposal: Sequence[int], start: int, n: int) -> list[list[int]]:
        """Per row, the tokens that would end a bad word there: a one-token word's always, a
        longer one's last where the output (and the proposed tokens the row follows) ends
        with the rest of it."""
        words = self.params.bad_words
        if not words:
            return []
        rows = []
        for i in range(n):
            tail = self.output + list(proposal[: start + i])
            rows.append([w[-1] for w in words if tail[len(tail) - len(w) + 1 :] == list(w[:-1])])
        return rows

    def _drafted(self, drafted: Sequence[int], start: int, n: int) -> torch.Tensor | None:
        """Counts [n, vocab] of the proposed tokens row i follows (the first start + i), or
        None when no row follows any."""
        if not drafted:
            return None
        rows = [i for i in range(n) for _ in range(start + i)]
        columns = [t for i in range(n) for t in drafted[: start + i]]
        counts = torch.zeros(n, self.vocab, device=self.device)
        ones = torch.ones(len(rows), device=self.device)
        return counts.index_put_((self._ids(rows), self._ids(columns)), ones, accumulate=True)


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Rows of fp32 logits [n, vocab] -> the distributions the request samples from.

    Greedy requests get a one-hot on the argmax, which keeps the verification rule uniform.
    The rows move to the CPU, where each request's seeded generator lives, so a seed gives the
    same tokens on any device.
    """
    logits = logits.float().cpu()
    if params.greedy:
        return one_hot_probs(logits.argmax(dim=-1), logits.shape[-1])
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def one_hot_probs(indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """Point-mass distributions, e.g. for proposals that come without probabilities."""
    return torch.nn.functional.one_hot(indices, vocab).float()


def sample(probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """One token per row of `probs` [n, vocab]."""
    return torch.multinomial(probs, 1, generator=generator).view(-1).tolist()
