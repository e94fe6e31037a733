"""Token sampling: greedy, temperature, top-k, top-p, with a seeded generator per request.

`token_probs` is the single place a request's sampling parameters shape a distribution, so
ordinary sampling, draft proposals and speculative verification all use the same one (the
lossless acceptance rule needs p and q to be the distributions actually sampled from).
"""

from __future__ import annotations

import torch

from replica.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded for reproducible requests, from OS entropy otherwise."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


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
