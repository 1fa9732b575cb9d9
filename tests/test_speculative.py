"""Speculative decoding with tree verification: a model's paged step over a draft tree (its own positions and
ancestor mask) gives each node the logits of its root path run from scratch; the draft's tree holds the draft's
top-k at each node's path; ``run.py generate --speculative`` emits plain greedy decoding's tokens with at least one
token per step."""

from __future__ import annotations

import re

import pytest
import torch

from engine import PagedKVCache, cli
from engine.masks.tree import tree_attention_inputs, tree_step_rows
from engine.paged.step import begin_step
from engine.speculative import _accept, _draft_tree, full_tree
from engine.tiny_decoder import TinyDecoder

VOCAB = 64


def model(layers=3, window=None):
    torch.manual_seed(0)
    return TinyDecoder(VOCAB, 32, layers, 4, 2, window=window).double().eval()


def root_path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def cache_for(net, page_size=4, pages=64):
    attn = net.blocks[0].attn
    return PagedKVCache(pages, page_size, attn.num_kv_heads, attn.head_dim, dtype=torch.float64,
                        layers=len(net.blocks))


def test_full_tree_and_tree_step_rows():
    assert full_tree(2, 2) == [-1, 0, 0, 1, 1, 2, 2]
    assert full_tree(1, 3) == [-1, 0, 1, 2]  # width 1: a chain
    assert len(full_tree(3, 2)) == 1 + 3 + 9
    trees, pasts = [[-1, 0, 0, 1], [-1, -1]], [5, 2]
    positions, allowed = tree_step_rows(trees, pasts)
    assert positions.tolist() == [5, 6, 6, 7, 2, 2]  # past + depth
    for b, (start, n) in enumerate(((0, 4), (4, 2))):
        want = tree_attention_inputs(trees[b], pasts[b])[2]  # [n, past + n]
        assert torch.equal(allowed[start:start + n, :pasts[b] + n], want)
        assert not allowed[start:start + n, pasts[b] + n:].any()  # K = 9: the longest sequence after the step
    positions, allowed = tree_step_rows(trees, pasts, new=[1, 0])  # only the first tree's last node
    assert positions.tolist() == [7] and torch.equal(allowed[0, :9], tree_attention_inputs(trees[0], 5)[2][3])
    with pytest.raises(ValueError, match=r"new must give each sequence a count in \[0, len\(its tree\)\]"):
        tree_step_rows(trees, pasts, new=[5, 0])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_tree_verified_in_one_paged_model_step_equals_each_root_path_run_from_scratch(page_size):
    net = model()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    trees = [[-1, 0, 0, 1, 1, 2, -1], [-1, 0, 1, 1]]
    tokens = [torch.randint(0, VOCAB, (len(t),), generator=torch.Generator().manual_seed(9 + b))
              for b, t in enumerate(trees)]
    cache = cache_for(net, page_size)
    seqs = [cache.add() for _ in prompts]
    net.forward_paged(torch.cat(prompts), cache, seqs, torch.tensor([0, 7, 19]))
    positions, allowed = tree_step_rows(trees, [7, 12])
    logits = net.forward_paged(torch.cat(tokens), cache, seqs, torch.tensor([0, 7, 11]), positions=positions,
                               allowed=allowed)  # [11, V]: both trees in one step
    row = 0
    for prompt, tree, toks in zip(prompts, trees, tokens):
        for node in range(len(tree)):
            path = torch.cat([prompt, toks[root_path(tree, node)]])  # the prompt, then the node's root path
            alone = net(path[None])[0, -1]  # [V]: one uncached forward, node last
            torch.testing.assert_close(logits[row], alone, rtol=1e-10, atol=1e-10)
            row += 1


def test_the_draft_tree_holds_the_drafts_top_k_after_each_nodes_path():
    net, width, depth = model(), 2, 3
    draft = net.first_layers(1)
    parents = full_tree(width, depth)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9)]
    cache = cache_for(draft)
    seqs = [cache.add() for _ in prompts]
    draft.forward_paged(torch.cat(prompts[:1] + [prompts[1][:6]]), cache, seqs, torch.tensor([0, 5, 11]))
    pending = [[], prompts[1][6:].tolist()]  # sequence 1 has 3 tokens the draft's cache has not taken yet
    roots = torch.tensor([3, 17])
    tree = _draft_tree(draft, cache, seqs, pending, roots, parents, width, depth)  # [2, 15]
    assert [cache.length(s) for s in seqs] == [6, 10]  # rolled back to the roots
    for b, prompt in enumerate(prompts):
        assert tree[b, 0] == roots[b]
        for node in range(1, len(parents)):
            parent = parents[node]
            context = torch.cat([prompt, tree[b, root_path(parents, parent)]])
            top = draft(context[None])[0, -1].topk(width).indices  # the draft's top-k after the parent's path
            assert tree[b, node] == top[(node - 1) % width], (b, node)


def test_accept_follows_the_targets_picks():
    parents = full_tree(2, 2)  # [-1, 0, 0, 1, 1, 2, 2]
    tokens = [9, 4, 5, 6, 7, 8, 1]
    assert _accept(parents, tokens, [5, 0, 1, 0, 0, 0, 0]) == [0, 2, 6]  # 5 is node 2, then 1 is node 6
    assert _accept(parents, tokens, [3, 0, 0, 0, 0, 0, 0]) == [0]  # no child matches: the bonus token alone


def test_a_tree_step_is_refused_before_the_cache_grows():
    net = model()
    cache = cache_for(net)
    seq = cache.add()
    net.forward_paged(torch.arange(5), cache, [seq], torch.tensor([0, 5]))
    positions, allowed = tree_step_rows([[-1, 0]], [5])
    for bad, message in (({"positions": positions[:1]}, r"positions must be an int tensor \[N\] = \[2\]"),
                         ({"positions": positions.double()}, "positions must be an int tensor"),
                         ({"allowed": allowed[:, :6]}, r"allowed must be a bool tensor \[N, K\] = \[2, >= 7\]"),
                         ({"allowed": allowed.long()}, "allowed must be a bool tensor")):
        with pytest.raises(ValueError, match=message):
            begin_step(cache, [seq], torch.tensor([0, 2]), **bad)
        assert cache.length(seq) == 5 and cache.extends == 1
    windowed = model(window=4)
    with pytest.raises(ValueError, match="cannot serve layers with a sliding window"):
        windowed.forward_paged(torch.arange(2), cache, [seq], torch.tensor([0, 2]), positions=positions,
                               allowed=allowed)
    assert cache.length(seq) == 5
    step = begin_step(cache, [seq], torch.tensor([0, 2]), positions=positions, allowed=allowed)
    attn = windowed.blocks[0].attn  # a layer called with a tree's step directly: its plan refuses the window
    with pytest.raises(ValueError, match="cannot serve a layer with a window of 4"):
        attn.forward_paged(torch.zeros(2, 32, dtype=torch.float64), cache, step=step, layer=0)


SMALL = ["generate", "--layers", "3", "--hidden", "32", "--heads", "4", "--vocab", "64", "--batch", "2",
         "--prompt-len", "10", "--new-tokens", "24", "--no-progress", "--no-check", "--speculative"]


@pytest.mark.parametrize("extra", [(), ("--ragged", "--paged", "3", "--tree-width", "3", "--tree-depth", "2"),
                                   ("--kv-dtype", "int8", "--draft-layers", "2", "--tree-width", "1")])
def test_generate_speculative_gives_plain_greedys_tokens(capsys, extra):
    code = cli.main([*SMALL, *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "speculative: same greedy tokens as plain greedy decoding: yes" in out
    mean = float(re.search(r"sequence-steps: mean ([\d.]+)", out).group(1))
    assert mean >= 1.0
    forwards = int(re.search(r"(\d+) target forwards after the prefill", out).group(1))
    assert forwards < 23  # fewer target forwards than plain greedy's 23 decode steps


def test_generate_speculative_refuses_a_window_and_bad_trees():
    with pytest.raises(ValueError, match="--window cannot be combined"):
        cli.main([*SMALL, "--window", "8"])
    with pytest.raises(ValueError, match="--tree-width and --tree-depth must be >= 1"):
        cli.main([*SMALL, "--tree-width", "0"])
    with pytest.raises(ValueError, match=r"--draft-layers in \[1, --layers = 3\]"):
        cli.main([*SMALL, "--draft-layers", "4"])
