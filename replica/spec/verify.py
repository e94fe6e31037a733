"""Verification of proposed tokens against the target model's distributions.

Both rules return the tokens to append: the accepted prefix of the proposal plus one token
from the target (the correction at the first rejection, or the bonus token when all pass), so
a verify step always makes progress.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from replica.spec.tree import TokenTree


def verify_choices(proposal: list[int], target_choices: list[int]) -> list[int]:
    """Longest prefix of `proposal` equal to the target's own choices, then the target's next
    token: the output is exactly what the target alone would choose (greedy: its argmax;
    seeded: its draw with the position's noise, replica.sampling).

    `target_choices[i]` is the target's choice after the context plus proposal[:i]
    (len(proposal) + 1 entries).
    """
    if len(target_choices) != len(proposal) + 1:
        raise ValueError(
            f"need {len(proposal) + 1} target tokens for {len(proposal)} proposed, "
            f"got {len(target_choices)}"
        )
    out: list[int] = []
    for token, choice in zip(proposal, target_choices, strict=False):
        out.append(choice)
        if token != choice:
            return out
    out.append(target_choices[len(proposal)])
    return out


def verify_stochastic(
    proposal: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Token i is accepted with probability min(1, p_i(x) / q_i(x)); at the first rejection the
    replacement is drawn from norm(max(0, p_i - q_i)); if all pass, a bonus token is drawn from
    p_k. The output is then distributed exactly as sampling from the target alone.
    `draft_probs` None means the proposal came without a distribution (n-gram lookup): a point
    mass on each proposed token, for which the same rule stays lossless.
    """
    k = len(proposal)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target distributions for {k} proposed tokens")
    if draft_probs is not None and draft_probs.shape[0] != k:
        raise ValueError(f"need {k} draft distributions for {k} proposed tokens")
    out: list[int] = []
    for i, token in enumerate(proposal):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[token] = 1.0
        else:
            q = draft_probs[i]
        if _accepts(p, q, token, generator):
            out.append(token)
            continue
        residual = _residual(p, q)
        out.append(_draw(p if residual is None else residual, generator))
        return out
    out.append(_draw(target_probs[k], generator))
    return out


def verify_tree_sampled(
    tree: TokenTree,
    target_probs: torch.Tensor,
    draft_probs: Mapping[int, torch.Tensor],
    generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """Lossless verification of a tree whose children of each node were drawn independently
    from the draft's distribution there (`draft_probs[node]`, over the whole vocabulary):
    SpecInfer's multi-step speculative sampling. At a node the children are tried in the order
    they were drawn: child x is accepted with probability min(1, p(x) / q(x)); after a refusal
    p becomes norm(max(0, p - q)), the target's distribution given that draw was refused; when
    every child is refused the token is drawn from the last p (from the target's own row where
    the node has no children). Each token is then distributed as the target's, whatever the
    tree's shape, provided the shape was chosen before the draws. `target_probs[i]`: the
    target's distribution after node i's path. Returns (accepted nodes, tokens to append)."""
    if target_probs.shape[0] != len(tree):
        raise ValueError(f"need {len(tree)} target distributions for a {len(tree)}-node tree")
    accepted: list[int] = []
    node = 0
    while True:
        p = target_probs[node]
        children = tree.children(node)
        if children and node not in draft_probs:
            raise ValueError(f"node {node} has children but no draft distribution")
        for child in children:
            q = draft_probs[node]
            token = tree.tokens[child]
            if _accepts(p, q, token, generator):
                accepted.append(child)
                node = child
                break
            residual = _residual(p, q)
            p = p if residual is None else residual / residual.sum().item()
        else:
            return accepted, [tree.tokens[i] for i in accepted] + [_draw(p, generator)]


def _accepts(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> bool:
    """The speculative-sampling test: `token`, drawn from q, is kept with chance
    min(1, p(token) / q(token))."""
    u = torch.rand((), generator=generator).item()
    return bool(u * q[token].item() < p[token].item())


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor | None:
    """max(0, p - q), unnormalised: what a refusal leaves to draw from (None: nothing, as when
    p and q agree)."""
    residual = torch.clamp(p - q, min=0.0)
    return residual if residual.sum().item() > 0.0 else None


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=generator).item())
