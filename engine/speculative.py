"""``run.py generate --speculative``: greedy speculative decoding, each step's draft tree verified in one paged call.

The draft is the target cut after its first ``--draft-layers`` blocks, with the target's embedding, final norm and
head (self-speculative decoding, LayerSkip's early exit; ``TinyDecoder.first_layers``); each model keeps its own
``PagedKVCache`` of every layer's pools. A step, for every sequence at once (packed):

    root: the pending token (the target's last greedy pick, in neither cache yet)
    1. draft: the root's top ``--tree-width`` next tokens are its children; each level's nodes, appended to the
       draft's cache as tree rows (engine.masks.tree.tree_step_rows), give theirs, down to ``--tree-depth`` levels
    2. verify: the target runs the whole tree (root included) in ONE paged forward: node i at slot past + i, RoPE
       position past + depth, seeing the cache and its ancestors; its greedy pick at every node
    3. accept: from the root, follow the child whose token is the target's pick, while there is one; the path is
       kept (``PagedKVCache.commit_tree``), the rest dropped; the target's pick at the path's end is the bonus
       token, the next root. The step emits the path's draft tokens and the bonus: len(path) tokens

    --tree-width 2 --tree-depth 3:  parents [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]  (15 nodes)
       level 0: node 0 (root)   level 1: 1, 2   level 2: 3..6   level 3: 7..14

Every emitted token is the target's greedy pick after the tokens before it, so the tokens equal plain greedy
decoding's (checked against the contiguous cache's run; a mismatch exits 1). The draft's cache drops its tree
rows after each step and takes the accepted tokens with the next step's root (one packed chunk).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from tqdm import tqdm

from engine.masks.tree import tree_step_rows
from engine.paged import PagedKVCache

__all__ = ["add_speculative_arguments", "check_speculative_arguments", "full_tree", "generate_speculative",
           "report_speculative"]

DEFAULT_PAGE_SIZE = 16  # --speculative without --paged


def full_tree(width: int, depth: int) -> list[int]:
    """Parents of a root (node 0, parent -1) whose nodes above ``depth`` each have ``width`` children, breadth
    first: ``sum(width**l for l in 0..depth)`` nodes."""
    parents, level = [-1], [0]
    for _ in range(depth):
        children = []
        for node in level:
            children += range(len(parents), len(parents) + width)
            parents += [node] * width
        level = children
    return parents


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative", action="store_true",
                        help="also decode greedily with a draft tree verified in one paged call per step (the paged "
                             f"cache of --paged, else pages of {DEFAULT_PAGE_SIZE}); check its tokens equal greedy's")
    parser.add_argument("--tree-width", type=int, default=2, help="draft tokens per node of the tree (default 2)")
    parser.add_argument("--tree-depth", type=int, default=3, help="draft levels below the root (default 3)")
    parser.add_argument("--draft-layers", type=int, default=1,
                        help="blocks of the target the draft keeps (default 1; with the target's embedding and head)")


def check_speculative_arguments(args: argparse.Namespace) -> None:
    """ValueError for options --speculative cannot serve (before the model runs)."""
    if not args.speculative:
        return
    if args.tree_width < 1 or args.tree_depth < 1 or not 1 <= args.draft_layers <= args.layers:
        raise ValueError(f"--tree-width and --tree-depth must be >= 1 and --draft-layers in [1, --layers = "
                         f"{args.layers}], got {args.tree_width}, {args.tree_depth}, {args.draft_layers}")
    if args.window is not None:
        raise ValueError("--speculative verifies a tree whose rows sit at slots past + i but positions past + depth; a "
                         "sliding window counts slots, so --window cannot be combined with it")


def _new_cache(model, sequences: int, tokens: int, page_size: int, dtype) -> PagedKVCache:
    attn, weight = model.blocks[0].attn, model.blocks[0].attn.k_proj.weight
    pages = sequences * (-(-tokens // page_size) + 1)
    return PagedKVCache(pages, page_size, attn.num_kv_heads, attn.head_dim, dtype=dtype or weight.dtype,
                        device=weight.device, layers=len(model.blocks))


def _packed(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])  # [B + 1]


def _draft_tree(draft, cache, seqs, pending: list[list[int]], roots, parents: list[int], width: int, depth: int):
    """Tree tokens ``[B, N]`` (column 0: the roots) from the draft: each sequence's pending tokens and its root as
    one chunk, then one tree step per level (its nodes' next-token logits give the next level); the draft's cache
    is rolled back to the roots after."""
    batch, device = len(seqs), roots.device
    chunks = [p + [int(r)] for p, r in zip(pending, roots.tolist())]
    indptr = _packed([len(c) for c in chunks])
    logits = draft.forward_paged(torch.tensor([t for c in chunks for t in c], device=device), cache, seqs, indptr)
    logits = logits[indptr[1:] - 1]  # [B, V]: after each root
    after_root = [cache.length(seq) for seq in seqs]
    first = [sum(width ** k for k in range(level)) for level in range(depth + 2)]  # level l: nodes first[l]..
    tokens = [roots[:, None]]  # per level, [B, width ** level]
    for level in range(1, depth + 1):
        tokens.append(logits.topk(width, dim=-1).indices.reshape(batch, -1))  # node by node, width children each
        if level == depth:
            break
        tree = [p - 1 for p in parents[1:first[level + 1]]]  # the draft's tree: the target's without its root
        count = first[level + 1] - first[level]
        positions, allowed = tree_step_rows([tree] * batch, after_root, [count] * batch, device)
        logits = draft.forward_paged(tokens[-1].reshape(-1), cache, seqs, _packed([count] * batch),
                                     positions=positions, allowed=allowed)  # [B * count, V]
    for seq, length in zip(seqs, after_root):
        cache.truncate(seq, length)
    return torch.cat(tokens, dim=1)  # [B, N]


def _accept(parents: list[int], tokens: list[int], picks: list[int]) -> list[int]:
    """The root path kept: from the root, the child whose token is the target's pick at its parent, while one is."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path = [0]
    while True:
        follow = [c for c in children.get(path[-1], []) if tokens[c] == picks[path[-1]]]
        if not follow:
            return path
        path.append(follow[0])  # (siblings are distinct top-k tokens: at most one matches)


@torch.no_grad()
def generate_speculative(model, ids, valid, new_tokens: int, page_size: int, width: int, depth: int,
                         draft_layers: int, kv_dtype=None, progress: bool = True):
    """Greedy tokens ``[B, new_tokens]`` of the prompts ``ids [B, T]`` (real tokens where ``valid``) by speculative
    decoding, the accepted path length of every sequence's step, the target's forwards after the prefill, the
    seconds taken and the tree's parents."""
    parents, draft = full_tree(width, depth), model.first_layers(draft_layers)
    prompts = [row[keep] for row, keep in zip(ids, valid)]
    room = max(len(p) for p in prompts) + new_tokens + 2 * len(parents)
    target_cache, draft_cache = (_new_cache(m, len(prompts), room, page_size, kv_dtype) for m in (model, draft))
    seqs = [target_cache.add() for _ in prompts]
    draft_seqs = [draft_cache.add() for _ in prompts]
    start = time.perf_counter()
    indptr = _packed([len(p) for p in prompts])
    roots = model.forward_paged(torch.cat(prompts), target_cache, seqs, indptr)[indptr[1:] - 1].argmax(-1)  # [B]
    draft.forward_paged(torch.cat(prompts), draft_cache, draft_seqs, indptr)
    emitted, pending = [[r] for r in roots.tolist()], [[] for _ in prompts]
    accepted, forwards = [], 0
    bar = tqdm(total=new_tokens - 1, desc="speculative", unit="tok", leave=False, disable=not progress)
    while min(len(e) for e in emitted) < new_tokens:
        tree = _draft_tree(draft, draft_cache, draft_seqs, pending, roots, parents, width, depth)  # [B, N]
        pasts = [target_cache.length(seq) for seq in seqs]
        positions, allowed = tree_step_rows([parents] * len(seqs), pasts, device=tree.device)
        logits = model.forward_paged(tree.reshape(-1), target_cache, seqs, _packed([len(parents)] * len(seqs)),
                                     positions=positions, allowed=allowed)  # [B * N, V]: the whole tree at once
        picks = logits.argmax(-1).reshape(len(seqs), -1).tolist()  # [B, N]
        forwards += 1
        before = min(len(e) for e in emitted)
        for b, seq in enumerate(seqs):
            path = _accept(parents, tree[b].tolist(), picks[b])
            target_cache.commit_tree(seq, parents, path)
            drafted = [int(tree[b, node]) for node in path[1:]]
            emitted[b] += drafted + [picks[b][path[-1]]]
            pending[b] = drafted  # the draft's cache takes them with the next root
            accepted.append(len(path))
        roots = torch.tensor([e[-1] for e in emitted], device=tree.device)  # [B]: the bonus tokens
        bar.update(min(min(len(e) for e in emitted), new_tokens) - before)
    bar.close()
    tokens = torch.tensor([e[:new_tokens] for e in emitted], device=ids.device)  # [B, new_tokens]
    return tokens, accepted, forwards, time.perf_counter() - start, parents


def report_speculative(model, ids, valid, tokens, args: argparse.Namespace, kv_dtype=None) -> bool:
    """Run ``generate_speculative`` with the command's options, print its figures beside plain greedy decoding's
    ``tokens``; True when its tokens are the same."""
    page_size = args.paged or DEFAULT_PAGE_SIZE
    spec, accepted, forwards, seconds, parents = generate_speculative(
        model, ids, valid, args.new_tokens, page_size, args.tree_width, args.tree_depth, args.draft_layers, kv_dtype,
        progress=not args.no_progress)
    same = torch.equal(spec, tokens)
    print(f"speculative: draft = the target's first {args.draft_layers} of {args.layers} blocks (same embedding and "
          f"head; self-speculative), tree width {args.tree_width} x depth {args.tree_depth} = {len(parents)} nodes "
          f"(root included) verified in one paged call per step (pages of {page_size})")
    print(f"speculative: same greedy tokens as plain greedy decoding: {'yes' if same else 'NO'}; "
          f"{ids.shape[0] * args.new_tokens} tokens in {seconds * 1e3:.1f} ms (both models' prefills included), "
          f"{forwards} target forwards after the prefill (plain greedy: {args.new_tokens - 1})")
    counts = Counter(accepted)
    print(f"accepted tokens per step (the path's drafts + the bonus token), {len(accepted)} sequence-steps: mean "
          f"{sum(accepted) / len(accepted):.2f}" if accepted else "accepted tokens per step: no step ran")
    for n in range(1, args.tree_depth + 2):
        share = counts[n] / max(len(accepted), 1)
        print(f"  {n:>3} tokens  {counts[n]:>5} steps  {share:>6.1%}  {'#' * round(40 * share)}")
    return same
