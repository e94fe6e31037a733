"""The simulated draft model's acceptance: what a verify of k drafts keeps.

Each drafted token is accepted with probability `alpha` until the first rejection (the i.i.d.
model behind E(s) = (1 - a^(s+1)) / (1 - a), the planner's budget formula). With a `spread`,
each request has its own alpha, drawn uniformly within `spread` of it: a draft model predicts
some texts far better than others. Every request draws from its own generator seeded by
(seed, request id), so the outcome of a request's verifies does not depend on how the cluster
interleaved it with other requests, and a run is reproducible for a seed.

With a `concentration` the draft model also says how sure it is (SpecServe's premise): each
drafted token gets a confidence c ~ Beta(alpha k, (1 - alpha) k), of mean alpha, and the target
accepts it with probability c (calibrated confidences). Each token is still accepted with
probability alpha, independently, so a policy that ignores confidences sees the same acceptance
as without them; the smaller k, the more the confidences tell apart tokens the target will
keep from those it will refuse.

`SimulatedTrees` extends the model to AdaServe's token trees: the target's token may also be
the draft's second or later choice, with the sibling acceptance the demo pair measured.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from replica.planner.config import check_fraction
from replica.planner.executor import leading_accepted
from replica.spec.tree import TokenTree, rank_chances, template_tree

DEFAULT_ACCEPTANCE = 0.6
"""Per-token acceptance assumed for OPT-125m drafting for OPT-7B: an assumption (the seed
papers give no measured figure for this pair), equal to the planner's prior
(`SpecConfig.initial_acceptance`), so planner and engine start from the same value."""


_EDGE = 1e-3
"""A request's alpha is kept this far inside (0, 1) for its confidences' Beta law."""


class SeededAcceptance:
    """`PerfExecutor`'s accept hook: accepted drafts of one verify, per-request streams."""

    def __init__(
        self, alpha: float, seed: int, spread: float = 0.0, concentration: float | None = None
    ) -> None:
        check_fraction("acceptance", alpha, low=0.0, high=1.0)
        check_fraction("acceptance_spread", spread, low=0.0, high=1.0)
        if concentration is not None:
            check_fraction("confidence_concentration", concentration, low=1e-3, high=1e6)
        self.alpha = float(alpha)
        self.spread = float(spread)
        self.concentration = None if concentration is None else float(concentration)
        self.seed = seed
        self._streams: dict[str, tuple[random.Random, float]] = {}

    def __call__(self, request_id: str, drafted: int) -> int:
        if self.concentration is not None:
            _, accepted_each = self.draws(request_id, drafted)
            return leading_accepted(accepted_each)
        rng, alpha = self._stream(request_id)
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        return accepted

    def draws(self, request_id: str, drafted: int) -> tuple[list[float], list[bool]]:
        """Each of `drafted` tokens' confidence and whether the target accepts it (needs a
        `concentration`)."""
        if self.concentration is None:
            raise ValueError("draft confidences need a confidence_concentration")
        rng, alpha = self._stream(request_id)
        mean = min(1.0 - _EDGE, max(_EDGE, alpha))
        a, b = mean * self.concentration, (1.0 - mean) * self.concentration
        confidences, accepted = [], []
        for _ in range(drafted):
            c = rng.betavariate(a, b)
            confidences.append(c)
            accepted.append(rng.random() < c)
        return confidences, accepted

    def uniform(self, request_id: str) -> float:
        """A draw in [0, 1) from the request's stream."""
        return self._stream(request_id)[0].random()

    def alpha_of(self, request_id: str) -> float:
        """The request's own acceptance."""
        return self._stream(request_id)[1]

    def _stream(self, request_id: str) -> tuple[random.Random, float]:
        stream = self._streams.get(request_id)
        if stream is None:
            rng = random.Random(f"{self.seed}:{request_id}")
            alpha = self.alpha
            if self.spread > 0:
                alpha = min(1.0, max(0.0, alpha + self.spread * (2 * rng.random() - 1)))
            stream = self._streams[request_id] = (rng, alpha)
        return stream

    def forget(self, request_id: str) -> None:
        """Drop a finished request's stream (a long run keeps only live ones)."""
        self._streams.pop(request_id, None)


DEFAULT_SIBLINGS = (0.40, 0.21, 0.20)
"""The chance the target takes the draft's second, third and fourth choice, each given it took
none before: the demo pair's, teacher forced on held-out Python (`slos-serve bench adaserve`,
its `sibling_acceptance`), assumed for every pair (no seed paper gives one)."""


class SimulatedTrees:
    """AdaServe's token trees in the simulated engine. At a node the walk reached, the
    target's token is the draft's first choice with the request's acceptance p_0 (as a chain's
    token is), and its rank-r choice with p_r = s_r (1 - p_0 - ... - p_(r-1)) for the
    `siblings` s (the last one for every later rank). A candidate tree is the beam the draft
    would grow: each level keeps the `width` children of highest path chance, a child of rank
    r having chance p_r (its token id is r); its f is that path chance, the calibration a live
    replica learns. A verify walks the kept nodes with the request's own stream."""

    def __init__(self, accept: SeededAcceptance, siblings: Sequence[float] = DEFAULT_SIBLINGS):
        if not siblings:
            raise ValueError("sibling_acceptance needs at least one value")
        for s in siblings:
            check_fraction("sibling_acceptance", s, low=0.0, high=1.0)
        self.accept = accept
        self.siblings = tuple(float(s) for s in siblings)

    def chances(self, request_id: str, width: int) -> list[float]:
        """p_r for ranks 0 .. width - 1."""
        return rank_chances((self.accept.alpha_of(request_id), *self.siblings), width)

    def candidate(self, request_id: str, depth: int, width: int) -> TokenTree:
        return template_tree(self.chances(request_id, width), depth, width)

    def walk(self, request_id: str, tree: TokenTree) -> list[int]:
        """The nodes of `tree` (children's token ids are ranks) the target accepts in one
        verify, root to leaf."""
        chances = self.chances(request_id, 1 + max(tree.tokens, default=0))
        node, accepted = 0, list[int]()
        while True:
            u, rank = self.accept.uniform(request_id), None
            for r, p in enumerate(chances):
                if u < p:
                    rank = r
                    break
                u -= p
            child = None if rank is None else tree.child(node, rank)
            if child is None:
                return accepted
            node = child
            accepted.append(child)
