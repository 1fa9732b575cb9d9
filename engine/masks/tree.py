"""Tree attention for speculative decoding: a tree of draft tokens verified in one call (EAGLE, Medusa, MTP).

A step drafts N tokens as a tree over the sequence's ``past`` cached tokens: node i's parent is ``parents[i]``
(an earlier node, or -1: a child of the last cached token). Node i sits at position ``past + depth(i)`` and sees
every cached key and its own ancestors (itself included), the engine's one rule with positions and ``allowed``::

    parents [-1, 0, 0, 1]          depths [0, 1, 1, 2]          positions past + [0, 1, 1, 2]
    node 3 sees: the cache, nodes 0, 1, 3 (its root path); node 2 sees: the cache, nodes 0, 2

``tree_attention_inputs(parents, past)`` gives ``(query_positions [N], key_positions [past + N], allowed [N, past +
N])`` for ``causal_attention(q_nodes, k, v, ...)`` over the cache's keys followed by the nodes' keys. A paged call
puts key j of a sequence at position j, so ``paged=True`` gives query positions ``past + N - 1`` (the rule then
admits the whole tree; the mask alone picks each node's ancestors) for ``paged_attention(..., query_positions,
allowed=allowed)``. Each node's output equals decoding its root path one token at a time. (Positions here are the
visibility rule's; RoPE takes ``past + depth``, applied to q and k before attention.)

A model's paged step over a ``PagedKVCache`` (engine.paged.step.begin_step's ``positions`` and ``allowed``) takes
``tree_step_rows(trees, pasts)``: several sequences' trees packed, each row's RoPE position and its keys; with
``new``, only each tree's last nodes (a tree drafted level by level: its earlier nodes appended by earlier steps).
After the verify, ``PagedKVCache.commit_tree`` keeps the accepted path.
"""

from __future__ import annotations

import torch

__all__ = ["tree_depths", "tree_attention_inputs", "tree_step_rows"]


def tree_depths(parents) -> torch.Tensor:
    """int64 ``[N]``: each node's depth (0 for a child of the cache's last token); a ValueError for a parent that is
    not an earlier node or -1."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    if parents.dim() != 1:
        raise ValueError(f"parents must be a 1-D list of node indices, got shape {list(parents.shape)}")
    depths = torch.zeros(parents.shape[0], dtype=torch.long)
    for i, parent in enumerate(parents.tolist()):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be an earlier node (0..{i - 1}) or -1 "
                             f"(a child of the last cached token)")
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths


def tree_attention_inputs(parents, past: int, device: torch.device | str = "cpu", paged: bool = False):
    """``(query_positions [N], key_positions [past + N], allowed bool [N, past + N])`` of a tree of N draft tokens
    over ``past`` cached tokens: node i at ``past + depth(i)``, seeing the cache and its ancestors (itself too);
    ``paged``: for a paged call, whose key j sits at position j (query positions ``past + N - 1``)."""
    if isinstance(past, bool) or not isinstance(past, int) or past < 0:
        raise ValueError(f"past must be the number of cached tokens, an int >= 0, got {past!r}")
    parents = torch.as_tensor(parents, dtype=torch.long)
    depths = tree_depths(parents)
    n = parents.shape[0]
    ancestors = torch.eye(n, dtype=torch.bool)  # [N, N]: row i, the nodes on i's root path
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            ancestors[i] |= ancestors[parent]
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool), ancestors], dim=1)  # [N, past + N]
    if paged:
        query_positions, key_positions = torch.full((n,), past + n - 1), torch.arange(past + n)
    else:
        query_positions, key_positions = past + depths, torch.cat([torch.arange(past), past + depths])  # [N], [past+N]
    return query_positions.to(device), key_positions.to(device), allowed.to(device)


def tree_step_rows(trees: list, pasts: list[int], new: list[int] | None = None, device: torch.device | str = "cpu"):
    """``(positions int64 [N], allowed bool [N, K])`` of one paged step that appends draft-tree nodes to several
    sequences, packed sequence by sequence: ``trees[b]`` is sequence b's parents list, ``pasts[b]`` its tokens before
    the tree's first node, ``new[b]`` how many of its tree's last nodes this step appends (default all). Row of node
    i: position ``past + depth(i)`` (RoPE), seeing its sequence's past keys and its ancestors' slots (node j at slot
    ``past + j``); K: the longest sequence after the step, ``max(past + len(tree))``."""
    if not isinstance(trees, (list, tuple)) or not isinstance(pasts, (list, tuple)) or len(trees) != len(pasts):
        raise ValueError(f"trees and pasts must be lists of one entry per sequence, got {type(trees).__name__} and "
                         f"{type(pasts).__name__} of lengths {len(trees)} and {len(pasts)}")
    new = [len(tree) for tree in trees] if new is None else list(new)
    if len(new) != len(trees) or any(not 0 <= k <= len(tree) for k, tree in zip(new, trees)):
        raise ValueError(f"new must give each sequence a count in [0, len(its tree)], got {new} for trees of "
                         f"{[len(tree) for tree in trees]} nodes")
    longest = max([past + len(tree) for past, tree in zip(pasts, trees)] + [0])
    positions, allowed = [], []
    for tree, past, count in zip(trees, pasts, new):
        n = len(tree)
        query_positions, _, mask = tree_attention_inputs(tree, past)  # [n], [n, past + n]
        positions.append(query_positions[n - count:])
        allowed.append(torch.nn.functional.pad(mask[n - count:], (0, longest - past - n)))  # [count, K]
    positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    allowed = torch.cat(allowed) if allowed else torch.zeros(0, longest, dtype=torch.bool)
    return positions.to(device), allowed.to(device)
