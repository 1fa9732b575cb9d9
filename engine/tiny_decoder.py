"""The tiny random-weight decoder ``run.py generate`` runs (engine.generate): the engine's layer in pre-norm blocks.

    ids [B, T] -> embed -> L x (RMSNorm -> MultiHeadAttention (RoPE, GQA, KV cache) -> RMSNorm -> SwiGLU MLP)
               -> RMSNorm -> lm_head -> logits [B, T, V]

``forward`` runs over one ``KVCache`` per layer (or none); ``forward_paged`` over one ``PagedKVCache`` of every
layer's pools, packed sequences, its step made once (engine.paged.step), a draft tree's rows included (their own
positions and ``allowed`` keys). ``first_layers(k)`` is the same model cut after k blocks, sharing its embedding,
final norm and head: the draft of self-speculative decoding (engine.speculative).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache import KVCache
from engine.layer import MultiHeadAttention
from engine.paged.step import begin_step

__all__ = ["Block", "RMSNorm", "TinyDecoder"]


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [B, T, E]
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    """Pre-norm transformer block: attention then a SwiGLU MLP, each added to the residual stream."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int | None, window: int | None) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = MultiHeadAttention(hidden, heads, kv_heads, head_dim=head_dim, window=window)
        self.gate, self.up = nn.Linear(hidden, 2 * hidden, bias=False), nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x, positions, cache, valid, plans=None):
        x = x + self.attn(self.attn_norm(x), positions=positions, cache=cache, valid=valid, plans=plans)  # [B, T, E]
        return self.mlp(x)

    def forward_paged(self, x, cache, step, layer: int):
        """Packed tokens ``[N, E]`` of several sequences, attending through the model's PagedKVCache (its
        ``layer``'s pools) in the step ``step`` (engine.paged.step)."""
        return self.mlp(x + self.attn.forward_paged(self.attn_norm(x), cache, step=step, layer=layer))  # [N, E]

    def mlp(self, x):
        h = self.mlp_norm(x)  # [..., E]
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))  # [..., E]


class TinyDecoder(nn.Module):
    """A decoder-only LM made of the engine's ``MultiHeadAttention``; one ``KVCache`` per layer."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int | None = None, window: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, head_dim, window) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def new_caches(self, batch: int, capacity: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        return [block.attn.new_cache(batch, capacity, dtype) for block in self.blocks]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None,
                caches: list[KVCache] | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """ids ``[B, T]`` -> logits ``[B, T, V]``; positions/valid ``[B, T]`` as in MultiHeadAttention. The layers
        step together, so the first one plans the attention call and the others reuse its plan."""
        plans: dict = {}  # this forward pass's plans (MultiHeadAttention's ``plans``)
        x = self.embed(ids)  # [B, T, E]
        for i, block in enumerate(self.blocks):
            x = block(x, positions, None if caches is None else caches[i], valid, plans)  # [B, T, E]
        return self.lm_head(self.norm(x))  # [B, T, V]

    def first_layers(self, count: int) -> TinyDecoder:
        """This model cut after its first ``count`` blocks (shared, not copied), with its embedding, final norm and
        head: a self-speculative draft (LayerSkip's early exit)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(self.blocks):
            raise ValueError(f"count must be an int in [1, {len(self.blocks)}] (the model's blocks), got {count!r}")
        draft = TinyDecoder.__new__(TinyDecoder)
        nn.Module.__init__(draft)
        draft.embed, draft.norm, draft.lm_head = self.embed, self.norm, self.lm_head
        draft.blocks = nn.ModuleList(list(self.blocks)[:count])
        return draft

    def forward_paged(self, ids: torch.Tensor, cache, seqs: list[int], indptr: torch.Tensor, *,
                      positions: torch.Tensor | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Packed ids ``[N]`` (``seqs[i]``: rows ``indptr[i] .. indptr[i+1]-1``) -> logits ``[N, V]`` over one
        PagedKVCache of every layer's pools: the step made once, every layer reusing it and its plan. ``positions``
        and ``allowed``: the rows' own positions and keys (a draft tree's: engine.masks.tree.tree_step_rows)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            raise ValueError(f"ids must be packed token ids [N], got {getattr(ids, 'shape', type(ids).__name__)}")
        if getattr(cache, "layers", None) != len(self.blocks):
            raise ValueError(f"cache must be a PagedKVCache of {len(self.blocks)} layers, got {cache!r}")
        windowed = [i for i, block in enumerate(self.blocks) if block.attn.window is not None]
        if positions is not None and windowed:
            raise ValueError(f"a step with its own positions (a draft tree's) cannot serve layers with a sliding "
                             f"window (layers {windowed}): the window would count slots, not the rows' positions")
        x = self.embed(ids)  # [N, E]
        for layer, block in enumerate(self.blocks):
            block.attn.check_paged_call(x, cache, layer)  # every layer's checks, before the cache grows
        step = begin_step(cache, seqs, indptr, positions=positions, allowed=allowed)  # once: pages, positions, tables
        for layer, block in enumerate(self.blocks):
            x = block.forward_paged(x, cache, step, layer)  # [N, E]
        return self.lm_head(self.norm(x))  # [N, V]
