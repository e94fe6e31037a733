"""AdaServe's SLO-customized token trees: pure, deterministic CPU logic.

Instead of a chain, each request verifies a tree of drafted tokens, so one forward can try
several continuations at each depth. The draft builds a candidate tree per request by beam
search (`tree_shape` sets its depth and width from the step's budget); a step's budget of tree
nodes is then spread over the requests by how many tokens each must gain now to stay on its
SLO line (`select_nodes`), most urgent first, the rest where the expected gain is highest. The
target runs the selected trees with a tree attention mask (`TokenTree.attn_mask`, positions =
context + depth) and verification walks each tree from its root by the target's own choices
(`verify_tree_choices`, `replica.spec.verify`'s chain rule for greedy requests on a tree).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTree:
    """Drafted tokens below a request's last known token.

    Node 0 is the root: the last known token, always fed to the target and never drafted.
    `probs[i]` is f(i), the draft's probability of the path from the root to i (the product
    along it): the expected number of tokens accepted is the sum of f over the nodes.
    """

    tokens: list[int]
    parents: list[int]
    """parents[0] == -1; 0 <= parents[i] < i otherwise, so a node's ancestors come first."""
    probs: list[float]
    ranks: list[int] = field(default_factory=list)
    """Each node's rank among the draft's choices after its parent (0: the likeliest; the
    root's 0), which a subtree keeps though it may drop a likelier sibling. Empty: the order
    of the siblings."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a token tree needs its root")
        if not self.ranks and len(self.parents) == n:
            self.ranks = [0] + [
                sum(1 for j in range(1, i) if self.parents[j] == self.parents[i])
                for i in range(1, n)
            ]
        if len(self.parents) != n or len(self.probs) != n or len(self.ranks) != n:
            raise ValueError(
                f"tokens, parents, probs and ranks differ in length: "
                f"{n}, {len(self.parents)}, {len(self.probs)}, {len(self.ranks)}"
            )
        if any(rank < 0 for rank in self.ranks):
            raise ValueError(f"ranks must be >= 0, got {self.ranks}")
        if self.parents[0] != -1:
            raise ValueError(f"the root's parent must be -1, got {self.parents[0]}")
        if self.probs[0] != 1.0:
            raise ValueError(f"the root's path probability must be 1.0, got {self.probs[0]}")
        for i in range(1, n):
            if not 0 <= self.parents[i] < i:
                raise ValueError(f"node {i}'s parent {self.parents[i]} does not precede it")
        for i, prob in enumerate(self.probs):
            if not 0.0 <= prob <= 1.0:
                raise ValueError(f"node {i}'s path probability {prob} is outside [0, 1]")

    @classmethod
    def root(cls, token: int) -> TokenTree:
        return cls(tokens=[token], parents=[-1], probs=[1.0])

    def add(self, parent: int, token: int, prob: float, rank: int | None = None) -> int:
        """Append a child of `parent` whose path probability is `prob` and rank among the
        draft's choices `rank` (None: after its siblings); returns its index."""
        if not 0 <= parent < len(self):
            raise ValueError(f"parent {parent} is not a node of a {len(self)}-node tree")
        if not 0.0 <= prob <= 1.0:
            raise ValueError(f"path probability {prob} is outside [0, 1]")
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.ranks.append(len(self.children(parent)) if rank is None else rank)
        self.tokens.append(token)
        self.parents.append(parent)
        self.probs.append(prob)
        return len(self) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        depths = [0] * len(self)
        for i in range(1, len(self)):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self)) if self.parents[i] == node]

    def child(self, node: int, token: int) -> int | None:
        """The child of `node` holding `token`, if any."""
        return next((c for c in self.children(node) if self.tokens[c] == token), None)

    def path(self, node: int) -> list[int]:
        """Nodes from the first below the root down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        out.reverse()
        return out

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def subtree(self, nodes: Sequence[int]) -> TokenTree:
        """The root plus `nodes`, renumbered in their old order so parents still come first.

        `nodes` must be closed under parents (each one's parent the root or among them), as
        `select_nodes` chooses them.
        """
        keep = sorted(set(nodes))
        new_index = {0: 0}
        for node in keep:
            if not 0 < node < len(self):
                raise ValueError(f"{node} is not a non-root node of a {len(self)}-node tree")
            if self.parents[node] not in new_index:
                raise ValueError(f"node {node}'s parent {self.parents[node]} is not kept")
            new_index[node] = len(new_index)
        return TokenTree(
            tokens=[self.tokens[0]] + [self.tokens[i] for i in keep],
            parents=[-1] + [new_index[self.parents[i]] for i in keep],
            probs=[1.0] + [self.probs[i] for i in keep],
            ranks=[0] + [self.ranks[i] for i in keep],
        )

    def attn_mask(self) -> list[list[bool]]:
        """[n][n]: node i attends to itself and its ancestors (the root included). Plain
        lists keep this module free of torch, which the simulator never loads."""
        mask: list[list[bool]] = []
        for i in range(len(self)):
            row = list(mask[self.parents[i]]) if i > 0 else [False] * len(self)
            row[i] = True
            mask.append(row)
        return mask

    def positions(self, first: int) -> list[int]:
        """Sequence positions when the root sits at `first`: siblings share one."""
        return [first + depth for depth in self.depths]


def select_nodes(
    trees: Sequence[TokenTree],
    needs: Sequence[float],
    budget: int,
    caps: Sequence[int],
    max_depth: int,
) -> list[list[int]]:
    """AdaServe's selection: per request, the sorted non-root nodes it verifies this step.

    `needs[i]` is A(r), the tokens request i must gain now to stay on its SLO line; `budget`
    bounds the nodes chosen over all requests (roots are free); request i gets at most
    `caps[i]`. Phase 1 serves the most urgent first, each until its expected gain (the sum of
    f, the root's 1.0 included) reaches min(need, max_depth + 1), the most a tree of
    depth max_depth can gain; phase 2 spends what is left where f is highest. Nodes come off a
    frontier heap (unchosen nodes whose parent is chosen), so every result is a valid tree.
    """
    if not len(trees) == len(needs) == len(caps):
        raise ValueError(
            f"trees, needs and caps differ in length: {len(trees)}, {len(needs)}, {len(caps)}"
        )
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if any(cap < 0 for cap in caps):
        raise ValueError(f"caps must be >= 0, got {list(caps)}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    frontiers: list[list[tuple[float, int]]] = [
        [(-tree.probs[c], c) for c in tree.children(0)] for tree in trees
    ]
    for frontier in frontiers:
        heapq.heapify(frontier)
    chosen: list[list[int]] = [[] for _ in trees]

    for i in sorted(range(len(trees)), key=lambda i: (-needs[i], i)):
        tree, frontier = trees[i], frontiers[i]
        goal = min(needs[i], max_depth + 1)
        gained = 1.0
        while budget > 0 and len(chosen[i]) < caps[i] and gained < goal and frontier:
            neg_f, node = heapq.heappop(frontier)
            chosen[i].append(node)
            for c in tree.children(node):
                heapq.heappush(frontier, (-tree.probs[c], c))
            gained -= neg_f
            budget -= 1

    pool = [(neg_f, i, node) for i, frontier in enumerate(frontiers) for neg_f, node in frontier]
    heapq.heapify(pool)
    while budget > 0 and pool:
        _, i, node = heapq.heappop(pool)
        if len(chosen[i]) >= caps[i]:
            continue
        chosen[i].append(node)
        tree = trees[i]
        for c in tree.children(node):
            heapq.heappush(pool, (-tree.probs[c], i, c))
        budget -= 1
    return [sorted(nodes) for nodes in chosen]


def tree_shape(budget: int, num_requests: int, max_depth: int, max_width: int) -> tuple[int, int]:
    """Depth and width of the candidate trees the draft builds this step.

    AdaServe adapts both to the budget each iteration but gives no constants; ours, with
    avg = budget / num_requests: depth = clip(floor(avg), 1, max_depth), so the draft never
    runs more forwards than the planner's longest chain, and width = clip(floor(avg / 2) + 1,
    1, max_width), growing with what each request may verify.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    if max_depth < 1 or max_width < 1:
        raise ValueError(f"max_depth and max_width must be >= 1, got {max_depth}, {max_width}")
    depth = min(max(budget // num_requests, 1), max_depth)
    width = min(budget // (2 * num_requests) + 1, max_width)
    return depth, width


def rank_chances(given_refused: Sequence[float], width: int) -> list[float]:
    """Each of ranks 0 .. width - 1's chance of being the child the target takes, at a node the
    walk reached, from each rank's chance given the ranks before it were refused
    (`given_refused`, its last value for every later rank)."""
    chances, left = [], 1.0
    for rank in range(width):
        share = left * given_refused[min(rank, len(given_refused) - 1)]
        chances.append(share)
        left -= share
    return chances


def template_tree(chances: Sequence[float], depth: int, width: int) -> TokenTree:
    """A beam over ranks alone: a child of rank r has chance `chances[r]` whatever its token,
    each level keeps the `width` children of highest path chance (ties: the earlier parent,
    then the lower rank), and a node's token id is its rank. The shape a tree takes when its
    tokens are drawn after it is chosen (sampled trees), and the simulated draft's beam."""
    tree = TokenTree.root(0)
    level = [0]
    for _ in range(depth):
        children = sorted(
            (
                (tree.probs[parent] * chance, parent, rank)
                for parent in level
                for rank, chance in enumerate(chances)
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[:width]
        level = [tree.add(parent, rank, f, rank) for f, parent, rank in children if f > 0.0]
        if not level:
            break
    return tree


def verify_tree_choices(tree: TokenTree, choices: Sequence[int]) -> tuple[list[int], list[int]]:
    """Follow the target's own choices down the tree (its argmax, after the request's logits
    shaping), so the output is exactly what the target alone would emit.

    `choices[i]` is the target's choice after node i's path. Returns the accepted nodes (root
    excluded, in path order) and the tokens to append: theirs, then the target's choice at the
    last node reached.
    """
    if len(choices) != len(tree):
        raise ValueError(f"need {len(tree)} target choices for a {len(tree)}-node tree")
    accepted: list[int] = []
    node = 0
    while (child := tree.child(node, choices[node])) is not None:
        accepted.append(child)
        node = child
    return accepted, [tree.tokens[i] for i in accepted] + [choices[node]]


def level_slots(depth: int, width: int) -> int:
    """Cache slots a tree of `depth` levels of `width` takes after its root as it grows: every
    level is fed but the deepest."""
    return max(0, depth - 1) * width


def judged_nodes(tree: TokenTree, accepted: Sequence[int]) -> int:
    """Nodes a walk judged: those it accepted, and the refusal where it stopped when that node
    had children (a chain's count, `planner.budget.judged_drafts`, on the path it took)."""
    last = accepted[-1] if accepted else 0
    return len(accepted) + (1 if tree.children(last) else 0)
