"""AdaServe's step-level choices (seed paper 000): how deep and wide the draft's candidate
trees grow, and how many tokens each request must gain in this step.

The SLOs-Serve planner still sizes each step: which requests decode and how many drafts each
may verify. With AdaServe the sum of those drafts is the step's node budget B, and a request's
drafts become a token tree (replica.spec.tree) instead of a chain: for a greedy request the
draft grows candidate trees by beam search; for one sampled without a seed the tree's shape is
chosen over draw indexes first and the draft then draws its tokens (verified losslessly by
SpecInfer's rule); a seeded request keeps its chain. The budget goes first to the requests
furthest behind their SLO line, then to the nodes likeliest to be accepted, whichever request
holds them. The target then verifies about as many tokens as planned, so the planner's step
time holds.

A(r), the tokens r must gain now, is measured on the deadline line the planner guarantees
(token j due at arrival + TTFT + j x TPOT, stages included): one for the next token if it
falls due by the end of this step, plus one per TPOT it is late then, fewer (down to zero and
below) while it is early. For a single-stage SLO this is the paper's (l + t_spec) / TPOT - o
with l counted from the first token's deadline rather than the first decode step. A
best-effort request (no SLO, or one the cluster could not guarantee) needs nothing and gets
only nodes the guaranteed requests leave.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replica.perf_model import BatchShape, BatchTimeModel
from replica.planner.config import check_int
from replica.planner.deadlines import remaining_tpot, token_deadline
from replica.planner.specserve import ConfidenceCalibration
from replica.request import Request, Tier
from replica.spec.tree import TokenTree, rank_chances, select_nodes, tree_shape


@dataclass(frozen=True)
class AdaServeConfig:
    """The constants AdaServe leaves open (our choices; replica.spec.tree.tree_shape)."""

    max_width: int = 4
    """Children kept per tree level, at most: wider trees try more continuations per depth, at
    the price of more draft work per level. The width a step takes is floor(drafts per
    request / 2) + 1 (`tree_shape`), so under the planner's at most 4 drafts a request it is
    at most 3, and only a max_width of 1 or 2 narrows it (4 is the C beam's widest)."""
    max_nodes: int = 15
    """Nodes one request may verify in a step (the paper's n_max): with its root, a tree of
    16 tokens, the most a row of the C kernels takes (model_runner.SMALL_QUERY)."""

    def __post_init__(self) -> None:
        check_int("adaserve.max_width", self.max_width)
        check_int("adaserve.max_nodes", self.max_nodes)


RANKS = 3
"""Sibling ranks calibrated apart: the draft's first, second, and any later choice."""


class TreeCalibration:
    """The chance the target accepts a tree node, learned per sibling rank and bin of the
    draft's probability of it (`ConfidenceCalibration`). AdaServe takes that probability as
    the chance; a small draft's is not (the demo draft's greedy drafts at 0.1-0.2 were accepted
    62% of the time), and its rank tells more: with raw probabilities, the beam and the
    selection preferred a second choice to the deeper first choices the target accepts."""

    def __init__(self) -> None:
        self.ranks = [ConfidenceCalibration() for _ in range(RANKS)]
        self.judged = [0] * RANKS
        """Nodes of each rank judged so far (their parent reached), whatever their confidence."""
        self.accepted = [0] * RANKS

    def chance(self, rank: int, confidence: float) -> float:
        return self.ranks[min(rank, RANKS - 1)].chance(confidence)

    def tables(self) -> list[list[float]]:
        """Each rank's chance per bin of confidence (what the C beam looks up)."""
        return [calibration.table() for calibration in self.ranks]

    def observe(self, rank: int, confidence: float, accepted: bool) -> None:
        rank = min(rank, RANKS - 1)
        self.ranks[rank].observe([confidence], 1 if accepted else 0)
        self.judged[rank] += 1
        self.accepted[rank] += accepted

    def rank_acceptance(self) -> list[float | None]:
        """The share of each rank's judged nodes the target accepted (None: none judged)."""
        return [a / j if j else None for a, j in zip(self.accepted, self.judged, strict=True)]


class DrawAcceptance:
    """A sampled tree's chances: that the target accepts a node's i-th drawn child given the
    ones before were refused (its first: a chain's token), learned per draw index from the
    verifies (a `ConfidenceCalibration` of one bin each: 0.5 with the weight of 4 judged
    nodes at first). Its shape is chosen before its tokens are drawn (losslessness needs
    it), so the chances know the index only."""

    def __init__(self) -> None:
        self.indexes = [ConfidenceCalibration(bins=1) for _ in range(RANKS)]

    def chances(self, width: int) -> list[float]:
        """Each draw index's chance of acceptance given its parent was reached, for indexes
        0 .. width - 1 (a draw is tried only after the ones before it were refused)."""
        return rank_chances([index.table()[0] for index in self.indexes], width)

    def observe(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """Learn from one verified sampled tree: at each node the walk reached, its children
        were tried in draw order up to the one accepted (or all of them)."""
        on_path = set(accepted)
        for node in (0, *accepted):
            for index, child in enumerate(tree.children(node)):
                taken = child in on_path
                self.indexes[min(index, RANKS - 1)].observe([0.5], int(taken))
                if taken:
                    break


class AdaServeTrees:
    """An engine's AdaServe policy over the perf model the controller plans with, and what it
    learns of the draft: a greedy tree's chances by rank and confidence (`calibration`), a
    sampled tree's by draw index (`sampled`; its shape is chosen before its draws)."""

    def __init__(
        self,
        perf: BatchTimeModel,
        config: AdaServeConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` must be the one requests' arrival times are read on."""
        self.perf = perf
        self.config = config if config is not None else AdaServeConfig()
        self.clock = clock
        self.calibration = TreeCalibration()
        self.sampled = DrawAcceptance()

    def shape(self, budget: int, num_requests: int, max_depth: int) -> tuple[int, int]:
        """Depth and width of this step's candidate trees."""
        return tree_shape(budget, num_requests, max_depth, self.config.max_width)

    def needs(
        self, requests: Sequence[tuple[Request, int]], step: BatchShape, now: float | None = None
    ) -> list[float]:
        """A(r) for each (request, tokens it has out) at the end of `step` as predicted, the
        step starting `now` (None: the clock's time)."""
        start = self.clock() if now is None else now
        end = start + self.perf.predict(step)
        return [tokens_needed(request, out, end) for request, out in requests]

    def choose(
        self,
        trees: Sequence[TokenTree],
        needs: Sequence[float],
        budget: int,
        planned: Sequence[int],
        depth: int,
        fits: Callable[[list[list[int]]], bool],
    ) -> list[list[int]]:
        """The nodes each tree verifies: the step's `budget` by `needs`, at most max_nodes a
        request (select_nodes); the `planned` split when `fits` says the KV of those would not
        fit (that split always does: the plan passed the capacity check)."""
        most = [self.config.max_nodes] * len(trees)
        chosen = select_nodes(trees, needs, budget, most, depth)
        return chosen if fits(chosen) else select_nodes(trees, needs, budget, planned, depth)

    def calibrated(self, tree: TokenTree) -> TokenTree:
        """The drafted tree (raw draft probabilities) with each node's f the product of the
        calibrated chances along its path."""
        probs = [1.0]
        confidences = _confidences(tree)
        for node in range(1, len(tree)):
            chance = self.calibration.chance(tree.ranks[node], confidences[node])
            probs.append(probs[tree.parents[node]] * chance)
        return TokenTree(list(tree.tokens), list(tree.parents), probs, list(tree.ranks))

    def observe(self, tree: TokenTree, accepted: Sequence[int]) -> None:
        """Learn from one verified tree (raw draft probabilities): each child of a node the
        walk reached was judged, and accepted if the walk went on through it."""
        reached = {0, *accepted}
        confidences = _confidences(tree)
        for node in range(1, len(tree)):
            if tree.parents[node] in reached:
                self.calibration.observe(tree.ranks[node], confidences[node], node in reached)


def tokens_needed(request: Request, out: int, by: float) -> float:
    """How many tokens beyond its first `out` the request must have out by time `by`."""
    if request.slo is None or request.tier is Tier.BEST_EFFORT:
        return 0.0
    return 1.0 + (by - token_deadline(request, out)) / remaining_tpot(request, out)


def _confidences(tree: TokenTree) -> list[float]:
    """Each node's draft probability given its parent (the root's 1), from the raw path
    probabilities."""
    out = [1.0]
    for node in range(1, len(tree)):
        above = tree.probs[tree.parents[node]]
        out.append(tree.probs[node] / above if above > 0.0 else 0.0)
    return out
