"""Multi-head attention as a layer around ``causal_attention``: the nine steps of multi-head attention, as the
attention-from-first-principles notes list them.

    x [B, T, E]
    1. q = x Wq^T                      [B, T, Hq*D]
    2. k = x Wk^T,  v = x Wv^T         [B, T, Hkv*D]
    3. split heads                     q [B, Hq, T, D],  k, v [B, Hkv, T, D]
    4. RoPE on q and k (never v)       at the tokens' positions
    5. cache k, v with positions       k, v [B, Hkv, S, D]  (S = cached + new)
    6. GQA: query head h reads KV head h // G   (inside causal_attention, no copy of k, v here)
    7. mask: key_pos <= query_pos, & window, & padding, & any extra ``allowed``
    8. softmax(q k^T * scale) v        [B, Hq, T, D]
    9. merge heads, output projection  [B, T, E]

MHA (Hkv = Hq), GQA (Hkv divides Hq) and MQA (Hkv = 1) are one code path. With a ``KVCache``, prefill,
chunked prefill and one-token decode are the same call: only the positions differ.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import merge_heads, split_heads
from engine.inputs import check_allowed, resolve_positions
from engine.kv_cache import KVCache
from engine.layer_config import check_layer_config
from engine.masks.padding import PaddingMask
from engine.masks.window import window_mask
from engine.paged import PagedKVCache
from engine.paged.step import PagedStep, begin_step, check_step
from engine.planning import plan, reuse
from engine.quantized import QuantizedKV
from engine.rope import apply_rope

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head / grouped-query / multi-query self-attention with RoPE and an optional KV cache.

    Args:
        hidden_size: model width E.
        num_heads: query heads Hq.
        num_kv_heads: key/value heads Hkv (default Hq); must divide Hq. 1 gives MQA.
        head_dim: D (default E // Hq); must be even when RoPE is on.
        bias: whether the q/k/v/o projections have a bias.
        rope_base: RoPE base; ``None`` turns RoPE off (absolute or no position encoding).
        rope_pairing: ``"half"`` (feature i with i + D/2) or ``"interleaved"`` (2i with 2i+1); see engine.rope.
        window: sliding window, the number of keys a query sees counting itself; ``None`` for no window.
        causal: False for bidirectional attention (encoders); only padding and ``allowed`` then restrict.
        scale: score multiplier (default 1 / sqrt(D)).
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` (Gemma-2).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = False,
        rope_base: float | None = 10000.0,
        rope_pairing: str = "half",
        window: int | None = None,
        causal: bool = True,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_dim = check_layer_config(hidden_size, num_heads, num_kv_heads, head_dim, bias, rope_base, rope_pairing,
                                 window, causal, scale, softcap)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_base, self.rope_pairing = rope_base, rope_pairing
        self.window, self.causal, self.scale, self.softcap = window, causal, scale, softcap
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def new_cache(self, batch_size: int, capacity: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """An empty ``KVCache`` shaped for this layer (dtype and device default to the weights')."""
        weight = self.k_proj.weight
        return KVCache(batch_size, self.num_kv_heads, capacity, self.head_dim,
                       dtype=weight.dtype if dtype is None else dtype,
                       device=weight.device if device is None else device)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
        plans: dict | None = None,
    ) -> torch.Tensor:
        """Attend the T new tokens ``x`` ``[B, T, E]`` to themselves and to the cache; returns ``[B, T, E]``.

        Args:
            x: ``[B, T, E]`` hidden states of the new tokens.
            positions: integer ``[T]`` or ``[B, T]``; default continues each row of the cache
                (``cache.next_positions + arange(T)``), or ``0..T-1`` without a cache.
            cache: a ``KVCache`` that receives the new keys and values (after RoPE) and supplies the old ones.
            valid: bool ``[B, T]``, False at pad tokens: pad keys are never seen and pad queries see
                nothing (their output is 0).
            allowed: extra bool mask broadcastable to ``[B, Hq, T, S]`` (e.g. ``document_mask``), S = keys
                after the write.
            plans: a dict shared by the layers of one forward pass that see the same positions, padding, mask
                and cache lengths (a decoder's layers, each with its own cache, stepping together): the first
                layer resolves positions, builds the mask and plans the attention call (engine.plan); every
                other layer with the same configuration reuses the plan. Start a new dict for each step.
        """
        context = None if plans is None else self._plan_key(x, cache)  # before this layer's write to its cache
        shared = None if plans is None else plans.get(("positions", context))  # [B, T], resolved by the first layer
        if shared is None:
            self._check_call(x, positions, cache, valid, allowed)
        batch, t, _ = x.shape
        if t == 0:  # nothing to attend; the cache is unchanged
            return x.new_zeros(batch, 0, self.o_proj.out_features)  # [B, 0, E]
        positions = self._resolve_positions(positions, cache, batch, t, x.device) if shared is None else shared
        if plans is not None:
            plans[("positions", context)] = positions
        q, k, v = self._project(x, positions)  # [B, Hq, T, D], [B, Hkv, T, D] x 2
        if cache is not None:
            k, v, key_positions, key_valid = cache.update(k, v, positions, valid)  # [B, Hkv, S, D], [B, S]
        else:
            key_positions, key_valid = positions, valid  # [B, T], [B, T] or None

        def make():
            mask = self._mask(positions, key_positions, valid, key_valid, allowed)  # [B, 1, T, S] or None
            return plan(q, k, v, positions, key_positions, mask, self.scale, causal=self.causal, softcap=self.softcap)

        step_plan = make() if plans is None else reuse(plans, context, (q, k, v), make)  # (engine.planning's key)
        out = step_plan.run(q, k, v)  # [B, Hq, T, D]
        return self.o_proj(merge_heads(out))  # [B, T, E]

    def forward_paged(self, x: torch.Tensor, cache: PagedKVCache, seqs: list[int] | None = None,
                      indptr: torch.Tensor | None = None, *, step: PagedStep | None = None, layer: int = 0
                      ) -> torch.Tensor:
        """Packed new tokens of several sequences, ``x [N, E]`` (sequence ``seqs[i]`` owns rows ``indptr[i] ..
        indptr[i+1]-1``, continuing at its length in ``cache``): their keys and values go to the sequences' pages
        and they attend to them (engine.paged_attention): a mixed batch of prefills and decodes, ``[N, E]``.

        A model's layers share one step (``engine.paged.step.begin_step(cache, seqs, indptr)``, made once per step
        over a cache of every layer's pools): pass ``step`` and this layer's index ``layer`` instead of ``seqs`` and
        ``indptr``; the step's plan is made by the first layer and reused by the others."""
        self.check_paged_call(x, cache, layer)  # before the cache grows
        if step is None:
            if cache.layers != 1:  # (a step per layer would grow every layer's sequences once per layer)
                raise ValueError(f"this cache holds {cache.layers} layers: make the step once "
                                 f"(engine.paged.step.begin_step) and pass step= and layer= to each layer")
            step = begin_step(cache, seqs, indptr, x.shape[0])
        else:
            check_step(step, cache, x.shape[0])
        q, k, v = self._project(x[None], step.positions[None])  # [1, Hq, N, D], [1, Hkv, N, D] x 2
        cache.write(step.slots, k[0].transpose(0, 1), v[0].transpose(0, 1), layer)  # [N, Hkv, D] each
        k_pages, v_pages = cache.layer(layer)
        q = q[0].transpose(0, 1)  # [N, Hq, D]
        out = step.plan_for(q, k_pages, v_pages, window=self.window, softcap=self.softcap,
                            scale=self.scale).run(q, k_pages, v_pages)  # [N, Hq, D]
        return self.o_proj(out.reshape(out.shape[0], -1))  # [N, E]

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """q, k, v of ``x [B, T, E]`` split into heads, RoPE applied at ``positions [B, T]``."""
        q = split_heads(self.q_proj(x), self.num_heads)  # [B, Hq, T, D]
        k = split_heads(self.k_proj(x), self.num_kv_heads)  # [B, Hkv, T, D]
        v = split_heads(self.v_proj(x), self.num_kv_heads)  # [B, Hkv, T, D]
        if self.rope_base is not None:
            q = apply_rope(q, positions, self.rope_base, self.rope_pairing)  # [B, Hq, T, D]
            k = apply_rope(k, positions, self.rope_base, self.rope_pairing)  # [B, Hkv, T, D]
        return q, k, v

    def _plan_key(self, x: torch.Tensor, cache: KVCache | None) -> tuple:
        """What a step's plan depends on besides the step's positions, padding and mask: this layer's
        configuration, x's shape, dtype and device, and the cache's fill and dtype."""
        fill = None if cache is None else (cache.length, cache.capacity, cache.keys.dtype)
        return (x.shape, x.dtype, x.device, self.num_heads, self.num_kv_heads, self.head_dim, self.window,
                self.causal, self.scale, self.softcap, self.rope_base, self.rope_pairing, fill, torch.is_grad_enabled())

    def _check_call(self, x, positions, cache, valid, allowed) -> None:
        """ValueError for any bad argument of forward, before anything (the cache included) is touched."""
        weight = self.q_proj.weight
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.q_proj.in_features:
            raise ValueError(f"x must be a tensor [B, T, E] with E = {self.q_proj.in_features}, "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.device != weight.device:
            raise ValueError(f"x must be on the layer's device {weight.device}, got {x.device}")
        autocast = torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type)
        if x.dtype != weight.dtype and not autocast:  # under autocast, nn.Linear casts x itself
            raise ValueError(f"x must have the layer's dtype {weight.dtype} (convert x or the layer), got {x.dtype}")
        batch, t, _ = x.shape
        if positions is not None:
            resolve_positions(positions, batch, t, 0, x.device, "positions")  # validates
        if valid is not None and (not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool
                                  or tuple(valid.shape) != (batch, t)):
            kind = f"{valid.dtype} {list(valid.shape)}" if isinstance(valid, torch.Tensor) else type(valid).__name__
            raise ValueError(f"valid must be a bool tensor [{batch}, {t}], got {kind}")
        self._check_cache_and_allowed(cache, allowed, batch, t, x.device)

    def check_paged_call(self, x, cache, layer: int) -> None:
        """ValueError for any bad argument of forward_paged, before the cache is touched (a refused call leaves it as
        it was, and a retry appends once)."""
        if not self.causal:
            raise ValueError("forward_paged serves causal decoders (a sequence's keys up to each query)")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.q_proj.in_features:
            raise ValueError(f"x must be packed tokens [N, E] with E = {self.q_proj.in_features}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        weight = self.q_proj.weight
        if x.device != weight.device or x.dtype != weight.dtype:
            raise ValueError(f"x must have the layer's dtype and device ({weight.dtype} on {weight.device}), got "
                             f"{x.dtype} on {x.device}")
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        pool = cache.keys.data if isinstance(cache.keys, QuantizedKV) else cache.keys  # [num_pages, P, Hkv, D]
        want = (self.num_kv_heads, self.head_dim, self.head_dim)
        have = (pool.shape[2], pool.shape[3], cache.values.shape[3])
        if have != want:
            raise ValueError(f"cache must hold [Hkv, D, Dv] = {list(want)} for this layer, got {list(have)}")
        if pool.device != x.device:
            raise ValueError(f"cache must be on x's device {x.device}, got {pool.device}")
        if not isinstance(cache.keys, QuantizedKV) and pool.dtype != x.dtype:
            raise ValueError(f"cache pages must have the layer's dtype {x.dtype} (or be quantized: int8 / fp8), got "
                             f"{pool.dtype}")
        if cache.window is not None and (self.window is None or cache.window < self.window):
            raise ValueError(f"the cache releases keys outside a window of {cache.window}, but this layer's queries "
                             f"see {'every earlier key' if self.window is None else f'{self.window} keys'}: make the "
                             f"cache with window=None or at least the layer's window ({self.window})")
        cache.layer(layer)  # (validates the index)

    def _check_cache_and_allowed(self, cache, allowed, batch, t, device) -> None:
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ValueError(f"cache must be a KVCache (see new_cache) or None, got {type(cache).__name__}")
            want = (batch, self.num_kv_heads, self.head_dim, self.head_dim)
            have = (cache.batch_size, cache.kv_heads, cache.keys.shape[-1], cache.values.shape[-1])
            if have != want:
                raise ValueError(f"cache must hold [B, Hkv, D, Dv] = {list(want)} for this call, got {list(have)}; "
                                 f"make it with layer.new_cache(batch_size, capacity)")
            if cache.keys.device != device:
                raise ValueError(f"cache must be on x's device {device}, got {cache.keys.device}")
        if allowed is not None:  # S = cached + new keys
            check_allowed(allowed, (batch, self.num_heads, t, t + (cache.length if cache is not None else 0)))

    def _resolve_positions(self, positions, cache, batch, t, device) -> torch.Tensor:
        if positions is None:
            start = cache.next_positions[:, None] if cache is not None else 0  # [B, 1] or 0
            return (start + torch.arange(t, device=device)).expand(batch, t)  # [B, T]
        return positions.to(device).expand(batch, t)  # [T] or [B, T] -> [B, T]

    def _mask(self, positions, key_positions, valid, key_valid, allowed) -> torch.Tensor | None:
        """Bool ``[B, 1 or Hq, T, S]`` (or None): window & key padding & query padding & extra ``allowed``."""
        mask = None
        if self.window is not None:
            mask = window_mask(positions, key_positions, self.window)  # [B, 1, T, S]
        queries_padded = valid is not None and not bool(valid.all())  # pad queries see nothing
        if queries_padded or (key_valid is not None and not bool(key_valid.all())):
            padding = PaddingMask(valid if queries_padded else None, key_valid)  # [B, 1, T|1, S]
            mask = padding if mask is None else mask & padding
        if allowed is not None:
            mask = allowed if mask is None else mask & allowed
        return mask
