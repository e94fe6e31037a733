"""AdaServe's token trees: structure, node selection, tree shape and verification."""

from __future__ import annotations

import random

import pytest

from replica.spec.tree import (
    TokenTree,
    judged_nodes,
    select_nodes,
    tree_shape,
    verify_tree_choices,
)


def _tree(tokens: list[int], parents: list[int], probs: list[float] | None = None) -> TokenTree:
    return TokenTree(tokens, parents, probs if probs is not None else [1.0] * len(tokens))


def _branchy() -> TokenTree:
    """0 -> {1, 2}; 2 -> {3, 4}; 4 -> {5}. Tokens are 10 + index."""
    return _tree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 2, 2, 4])


@pytest.mark.parametrize(
    ("tokens", "parents", "probs", "message"),
    [
        ([], [], [], "root"),
        ([1, 2], [-1], [1.0, 0.5], "length"),
        ([1, 2], [0, 0], [1.0, 0.5], "root's parent"),
        ([1, 2], [-1, 0], [0.5, 0.5], "root's path probability"),
        ([1, 2, 3], [-1, 2, 0], [1.0, 0.5, 0.5], "precede"),
        ([1, 2], [-1, 1], [1.0, 0.5], "precede"),
        ([1, 2], [-1, 0], [1.0, 1.5], "outside"),
        ([1, 2], [-1, 0], [1.0, -0.1], "outside"),
    ],
)
def test_token_tree_rejects_malformed_fields(
    tokens: list[int], parents: list[int], probs: list[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TokenTree(tokens, parents, probs)


def test_token_tree_structure() -> None:
    tree = TokenTree.root(7)
    a = tree.add(0, 8, 0.6)
    b = tree.add(0, 9, 0.3)
    c = tree.add(a, 4, 0.3)
    d = tree.add(c, 5, 0.15)
    e = tree.add(a, 6, 0.2)
    assert (a, b, c, d, e) == (1, 2, 3, 4, 5)
    assert len(tree) == 6
    assert tree.parents == [-1, 0, 0, 1, 3, 1]
    assert tree.probs == [1.0, 0.6, 0.3, 0.3, 0.15, 0.2]
    assert tree.depths == [0, 1, 1, 2, 3, 2]
    assert tree.children(0) == [1, 2]
    assert tree.children(1) == [3, 5]
    assert tree.children(4) == []
    assert tree.path(0) == []
    assert tree.path(4) == [1, 3, 4]
    assert tree.path_tokens(4) == [8, 4, 5]
    assert tree.path_tokens(0) == []
    with pytest.raises(ValueError, match="parent"):
        tree.add(6, 1, 0.1)
    with pytest.raises(ValueError, match="outside"):
        tree.add(0, 1, 1.1)


def test_subtree_renumbers_in_old_order() -> None:
    tree = _tree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 2, 2, 4], [1.0, 0.5, 0.4, 0.1, 0.3, 0.2])
    sub = tree.subtree([5, 2, 4])
    assert sub.tokens == [10, 12, 14, 15]
    assert sub.parents == [-1, 0, 1, 2]
    assert sub.probs == [1.0, 0.4, 0.3, 0.2]
    assert tree.subtree([]).tokens == [10]
    with pytest.raises(ValueError, match="not kept"):
        tree.subtree([2, 5])
    with pytest.raises(ValueError, match="non-root"):
        tree.subtree([0, 1])
    with pytest.raises(ValueError, match="non-root"):
        tree.subtree([6])


def test_attn_mask_sees_self_and_ancestors() -> None:
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1, 1],
    ]
    assert _branchy().attn_mask() == [[bool(v) for v in row] for row in expected]


def test_positions_follow_depth() -> None:
    assert _branchy().positions(100) == [100, 101, 101, 102, 102, 103]
    assert TokenTree.root(3).positions(0) == [0]


def _selection_trees() -> list[TokenTree]:
    # Request 0: 0 -> {1 (.5), 3 (.3)}; 1 -> 2 (.45); 2 -> 4 (.2).
    # Request 1: 0 -> {1 (.9), 3 (.05)}; 1 -> 2 (.7).
    return [
        _tree([0, 1, 2, 3, 4], [-1, 0, 1, 0, 2], [1.0, 0.5, 0.45, 0.3, 0.2]),
        _tree([0, 1, 2, 3], [-1, 0, 1, 0], [1.0, 0.9, 0.7, 0.05]),
    ]


def test_select_serves_the_neediest_first_until_its_need_is_met() -> None:
    trees = _selection_trees()
    caps = [10, 10]
    # Budget 3: request 0 (need 2) takes .5, .45, .3 (1 + 1.25 >= 2) though request 1 has .9.
    assert select_nodes(trees, [2.0, 1.5], 3, caps, max_depth=4) == [[1, 2, 3], []]
    # Budget 5: request 1 (need 1.5) stops after .9; the one left goes to the highest f, .7.
    assert select_nodes(trees, [2.0, 1.5], 5, caps, max_depth=4) == [[1, 2, 3], [1, 2]]
    # Budget 6: then .2 of request 0 over .05 of request 1.
    assert select_nodes(trees, [2.0, 1.5], 6, caps, max_depth=4) == [[1, 2, 3, 4], [1, 2]]
    # Order is by need, not by index.
    assert select_nodes(trees, [1.5, 2.5], 3, caps, max_depth=4) == [[1], [1, 2]]


def test_select_bounds_a_need_by_the_depth() -> None:
    trees = _selection_trees()
    caps = [10, 10]
    # need 10 with max_depth 1: request 0 stops once 1 + f sum >= 2.
    assert select_nodes(trees, [10.0, 1.5], 4, caps, max_depth=1) == [[1, 2, 3], [1]]
    assert select_nodes(trees, [10.0, 1.5], 4, caps, max_depth=4) == [[1, 2, 3, 4], []]


def test_select_caps_budget_and_idle_requests() -> None:
    trees = _selection_trees()
    assert select_nodes(trees, [2.0, 1.5], 10, [1, 0], max_depth=4) == [[1], []]
    assert select_nodes(trees, [2.0, 1.5], 0, [10, 10], max_depth=4) == [[], []]
    # No need: nothing in phase 1, only what phase 2 finds highest (.9, then .7 over .5).
    assert select_nodes(trees, [0.0, -3.0], 2, [10, 10], max_depth=4) == [[], [1, 2]]


def test_select_rejects_bad_inputs() -> None:
    trees = _selection_trees()
    with pytest.raises(ValueError, match="length"):
        select_nodes(trees, [1.0], 3, [1, 1], max_depth=2)
    with pytest.raises(ValueError, match="length"):
        select_nodes(trees, [1.0, 1.0], 3, [1], max_depth=2)
    with pytest.raises(ValueError, match="budget"):
        select_nodes(trees, [1.0, 1.0], -1, [1, 1], max_depth=2)
    with pytest.raises(ValueError, match="caps"):
        select_nodes(trees, [1.0, 1.0], 3, [1, -1], max_depth=2)
    with pytest.raises(ValueError, match="max_depth"):
        select_nodes(trees, [1.0, 1.0], 3, [1, 1], max_depth=0)


def _random_tree(rng: random.Random) -> TokenTree:
    tree = TokenTree.root(rng.randrange(50))
    for _ in range(rng.randrange(12)):
        parent = rng.randrange(len(tree))
        tree.add(parent, rng.randrange(50), tree.probs[parent] * rng.random())
    return tree


def test_select_gives_valid_trees_within_budget_and_caps() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 5)
        trees = [_random_tree(rng) for _ in range(n)]
        needs = [rng.uniform(-1.0, 6.0) for _ in range(n)]
        caps = [rng.randint(0, 6) for _ in range(n)]
        budget = rng.randint(0, 20)
        chosen = select_nodes(trees, needs, budget, caps, max_depth=rng.randint(1, 4))
        assert len(chosen) == n
        for tree, nodes, cap in zip(trees, chosen, caps, strict=True):
            assert nodes == sorted(set(nodes))
            assert len(nodes) <= cap
            tree.subtree(nodes)  # raises unless parent-closed
        available = sum(min(cap, len(tree) - 1) for tree, cap in zip(trees, caps, strict=True))
        assert sum(map(len, chosen)) == min(budget, available)


def test_tree_shape() -> None:
    assert tree_shape(8, 4, max_depth=5, max_width=3) == (2, 2)
    assert tree_shape(7, 2, max_depth=6, max_width=8) == (3, 2)
    assert tree_shape(0, 4, max_depth=5, max_width=3) == (1, 1)
    assert tree_shape(100, 2, max_depth=5, max_width=3) == (5, 3)
    for args in [(4, 0, 2, 2), (-1, 1, 2, 2), (4, 1, 0, 2), (4, 1, 2, 0)]:
        with pytest.raises(ValueError):
            tree_shape(*args)


def test_choices_follow_a_later_branch() -> None:
    # At the root the target picks 12 (node 2, the second child), then 14 (node 4), then 99.
    assert verify_tree_choices(_branchy(), [12, 0, 14, 0, 99, 0]) == ([2, 4], [12, 14, 99])


def test_choices_mismatch_at_the_root_gives_the_target_token() -> None:
    assert verify_tree_choices(_branchy(), [7, 11, 12, 13, 14, 15]) == ([], [7])


def test_choices_down_to_a_leaf_add_the_bonus() -> None:
    assert verify_tree_choices(_branchy(), [12, 0, 14, 0, 15, 16]) == ([2, 4, 5], [12, 14, 15, 16])
    with pytest.raises(ValueError, match="6 target choices"):
        verify_tree_choices(_branchy(), [12, 14])


def test_a_walk_judges_its_path_and_the_refusal_where_it_stopped() -> None:
    tree = _branchy()  # 0 -> {1, 2}; 2 -> {3, 4}; 4 -> {5}
    assert judged_nodes(tree, []) == 1, "the root's children were judged and refused"
    assert judged_nodes(tree, [2]) == 2, "node 2's children too"
    assert judged_nodes(tree, [2, 4, 5]) == 3, "a leaf: nothing refused below it"
    assert judged_nodes(_tree([10], [-1]), []) == 0


def test_ranks_follow_the_siblings_unless_given_and_survive_a_subtree() -> None:
    tree = _branchy()
    assert tree.ranks == [0, 0, 1, 0, 1, 0]
    tree.add(0, 30, 0.1, rank=3)
    assert tree.ranks[-1] == 3
    assert tree.subtree([2, 4]).ranks == [0, 1, 1]
    with pytest.raises(ValueError, match="ranks must be >= 0"):
        TokenTree([1, 2], [-1, 0], [1.0, 0.5], [0, -1])
