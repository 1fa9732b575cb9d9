"""Tree verification for speculative decoding: a tree of draft tokens in one call, contiguous or paged, equals
decoding each node's root path one token at a time (engine.masks.tree)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import causal_attention
from engine.masks.tree import tree_attention_inputs, tree_depths

HQ, HKV, D = 4, 2, 16


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    return parents, draw(st.integers(0, 20)), draw(st.integers(0, 10_000))


def root_path(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@settings(max_examples=40, deadline=None)
@given(trees(), st.sampled_from(["auto", "tiled", "reference"]))
def test_each_node_equals_decoding_its_root_path_one_token_at_a_time(tree, kernel):
    parents, past, seed = tree
    n = len(parents)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, n, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, HKV, past + n, D, generator=g, dtype=torch.float64) for _ in range(2))  # cache, then nodes
    qpos, kpos, allowed = tree_attention_inputs(parents, past)
    out = causal_attention(q, k, v, qpos, kpos, allowed, kernel=kernel)  # [1, Hq, N, D]: the whole tree at once
    for i in range(n):
        path = root_path(parents, i)  # the tokens decoded before node i, and node i, in order
        keys = list(range(past)) + [past + j for j in path]
        alone = causal_attention(q[:, :, i:i + 1], k[:, :, keys], v[:, :, keys])  # its query at the last key
        torch.testing.assert_close(out[:, :, i:i + 1], alone, rtol=1e-10, atol=1e-10)


def test_a_tree_verified_in_one_paged_call_equals_the_contiguous_call():
    parents, past, page_size = [-1, 0, 0, 1, 1, 2, -1], 37, 16
    n = len(parents)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n, HQ, D, generator=g)
    k, v = (torch.randn(past + n, HKV, D, generator=g) for _ in range(2))  # the sequence's keys, the nodes' last
    pages = -(-(past + n) // page_size)
    table = torch.randperm(pages + 2, generator=g)[:pages][None]  # [1, pages]
    pools = [torch.full((pages + 2, page_size, HKV, D), float("nan")) for _ in "kv"]  # unowned slots NaN
    for j in range(past + n):
        page, slot = table[0, j // page_size], j % page_size
        pools[0][page, slot], pools[1][page, slot] = k[j], v[j]
    qpos, kpos, allowed = tree_attention_inputs(parents, past)
    want = causal_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], qpos, kpos,
                            allowed)[0].transpose(0, 1)  # [N, Hq, D]
    # paged: key j of the sequence sits at position j; the rule admits the whole tree, the mask picks the ancestors
    paged_pos, _, paged_allowed = tree_attention_inputs(parents, past, paged=True)
    step = engine.plan_paged(q, *pools, table, torch.tensor([past + n]), torch.tensor([0, n]), paged_pos,
                             allowed=paged_allowed)
    torch.testing.assert_close(step.run(q, *pools), want, rtol=1e-5, atol=1e-5)
    assert step.path == "native in place", str(step)  # one sequence of 7 queries: the native kernel, in place


def test_bad_trees_are_refused():
    assert tree_depths([-1, 0, 1, 0, -1]).tolist() == [0, 1, 2, 1, 0]
    with pytest.raises(ValueError, match=r"parents\[1\] = 1: a node's parent must be an earlier node"):
        tree_depths([-1, 1])
    with pytest.raises(ValueError, match=r"parents\[0\] = -2"):
        tree_depths([-2])
    with pytest.raises(ValueError, match="past must be the number of cached tokens"):
        tree_attention_inputs([-1], -1)
