"""Multi-head latent attention (MLA: DeepSeek V2 / V3, Kimi K2), expanded or absorbed, over a latent cache.

MLA caches one small row per token for all H heads: the latent ``c_kv`` (R = kv_lora_rank numbers) and one RoPE
key ``k_pe`` (r numbers) every head shares. Per-head keys and values are linear in ``c_kv``::

    x [B, T, E]
    q        = q_b(RMSNorm(q_a(x)))  (q LoRA) or q_proj(x)       [B, H, T, n + r]  = [q_nope | q_pe]
    row      = [RMSNorm(c_kv) | RoPE(k_pe)] = kv_a(x)            [B, 1, T, R + r]  the cache's row (576 in V3)
    kv_b     = [W_UK; W_UV] per head                              W_UK [H, n, R], W_UV [H, v, R]

    expanded (training, prefill):   k = [W_UK c_kv | k_pe] [B, H, S, n + r],  v = W_UV c_kv [B, H, S, v]
                                    out = softmax(q k^T * scale) v
    absorbed (decode):              q_lat = q_nope W_UK                       [B, H, T, R]
                                    q' = [q_lat | q_pe]  against  k = row [B, 1, S, R + r],  v = row[..., :R]
                                    out = (softmax(q' k^T * scale) v) W_UV^T  [B, H, T, v]

The two are one function (q_nope . (W_UK c) = (q_nope W_UK) . c, and the weights sum to one): the absorbed form reads
R + r numbers per key once for all H heads (one KV head, MQA; V the first R columns of K's rows: engine.shared_rows)
where the expanded one reads H (n + r + v). DeepSeek V3 (H 128, n 128, r 64, v 128, R 512): 576 numbers per token
and layer against 40,960. ``scale`` is the expanded form's, ``1 / sqrt(n + r)``, in both.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import merge_heads, split_heads
from engine.inputs import resolve_positions
from engine.kernels.common import MAX_DECODE_QUERIES
from engine.kv_cache import KVCache
from engine.norms import RMSNorm
from engine.paged import PagedKVCache
from engine.paged.step import PagedStep, begin_step, check_step
from engine.planning import plan
from engine.quantized import QuantizedKV
from engine.rope import PAIRINGS, apply_rope
from engine.shared_rows import shares_rows

__all__ = ["LatentAttention"]


class LatentAttention(nn.Module):
    """MLA self-attention with RoPE on its shared key; module names as DeepSeek checkpoints' (``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``), so their attention weights load with ``load_state_dict``.

    Args:
        hidden_size: E.  num_heads: H.  kv_lora_rank: R (the latent's width).  q_lora_rank: the query's low rank,
        or None for one projection.  qk_nope_head_dim / qk_rope_head_dim: n / r (the key's parts without and with
        RoPE).  v_head_dim: v.  rope_base, rope_pairing: as engine.rope ("interleaved" is DeepSeek's layout).
        scale: default ``1 / sqrt(n + r)``.  eps: the RMSNorms'.  bias: on q_a / kv_a / o_proj (``attention_bias``).
    """

    def __init__(self, hidden_size: int, num_heads: int, kv_lora_rank: int = 512, q_lora_rank: int | None = 1536,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128,
                 rope_base: float = 10000.0, rope_pairing: str = "interleaved", scale: float | None = None,
                 eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        sizes = dict(hidden_size=hidden_size, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                     qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
        for name, n in {**sizes, "q_lora_rank": 1 if q_lora_rank is None else q_lora_rank}.items():
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE turns pairs), got {qk_rope_head_dim}")
        if rope_pairing not in PAIRINGS:
            raise ValueError(f"rope_pairing must be one of {PAIRINGS}, got {rope_pairing!r}")
        if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"scale must be a positive number or None, got {scale!r}")
        self.num_heads, self.kv_lora_rank, self.q_lora_rank = num_heads, kv_lora_rank, q_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_base, self.rope_pairing = rope_base, rope_pairing
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if scale is None else float(scale)
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    @property
    def row_width(self) -> int:
        """R + r: numbers per token and layer in the latent cache."""
        return self.kv_lora_rank + self.rope

    def new_cache(self, batch_size: int, capacity: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """An empty latent ``KVCache``: one KV head of ``R + r`` numbers per token, its values the first R
        (``shared_values``; int8 / fp8 quantize each row with one scale)."""
        weight = self.kv_a_proj_with_mqa.weight
        return KVCache(batch_size, 1, capacity, self.row_width, value_dim=self.kv_lora_rank,
                       dtype=weight.dtype if dtype is None else dtype,
                       device=weight.device if device is None else device, shared_values=True)

    def new_paged_cache(self, num_pages: int, page_size: int, layers: int = 1, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> PagedKVCache:
        """An empty latent ``PagedKVCache`` (one pool of rows per layer, the values their first R columns)."""
        weight = self.kv_a_proj_with_mqa.weight
        return PagedKVCache(num_pages, page_size, 1, self.row_width, value_dim=self.kv_lora_rank,
                            dtype=weight.dtype if dtype is None else dtype,
                            device=weight.device if device is None else device, layers=layers, shared_values=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                absorbed: bool | None = None) -> torch.Tensor:
        """Attend the T new tokens ``x [B, T, E]`` to themselves and the cache's rows; ``[B, T, E]``.

        positions: integer ``[T]`` or ``[B, T]`` (default: each row continues its cache, or 0..T-1).
        cache: a latent cache (``new_cache``) that takes the new rows.
        absorbed: True for the absorbed form, False for the expanded one; None: absorbed for a decode step (a
        cache and T <= 16), expanded otherwise (its keys cost H (n + r + v) numbers per key to make, once).
        """
        batch, t = self._check_call(x, cache)
        if positions is None:
            start = cache.next_positions[:, None] if cache is not None else 0  # [B, 1] or 0
            positions = (start + torch.arange(t, device=x.device)).expand(batch, t)  # [B, T]
        else:
            positions = resolve_positions(positions, batch, t, 0, x.device, "positions")  # [B, T]
        q_nope, q_pe, rows = self._project(x, positions)  # [B, H, T, n], [B, H, T, r], [B, 1, T, R + r]
        key_positions = positions
        if cache is not None:
            rows, _, key_positions, _ = cache.update(rows, None, positions)  # [B, 1, S, R + r], [B, S]
        if t == 0:
            return x.new_zeros(batch, 0, self.o_proj.out_features)  # [B, 0, E]
        if absorbed if absorbed is not None else (cache is not None and t <= MAX_DECODE_QUERIES):
            q = self._absorbed_query(q_nope, q_pe)  # [B, H, T, R + r]
            latent = rows[..., : self.kv_lora_rank]  # [B, 1, S, R]: the values are the rows' first R columns
            out = plan(q, rows, latent, positions, key_positions, scale=self.scale).run(q, rows, latent)
            out = self._values_out(out)  # [B, H, T, R] -> [B, H, T, v]
        else:
            k, v = self.expand(rows)  # [B, H, S, n + r], [B, H, S, v]
            q = torch.cat([q_nope, q_pe], dim=-1)  # [B, H, T, n + r]
            out = plan(q, k, v, positions, key_positions, scale=self.scale).run(q, k, v)  # [B, H, T, v]
        return self.o_proj(merge_heads(out))  # [B, T, E]

    def forward_paged(self, x: torch.Tensor, cache: PagedKVCache, seqs: list[int] | None = None,
                      indptr: torch.Tensor | None = None, *, step: PagedStep | None = None, layer: int = 0
                      ) -> torch.Tensor:
        """Packed new tokens ``x [N, E]`` of several sequences (as ``MultiHeadAttention.forward_paged``): their rows
        go to the latent pages, and every query attends in the absorbed form, read in place; ``[N, E]``."""
        if not isinstance(cache, PagedKVCache) or not shares_rows(cache.keys, cache.values):
            raise ValueError(f"cache must be a latent PagedKVCache (layer.new_paged_cache), got "
                             f"{type(cache).__name__}")
        pool = cache.keys.data if isinstance(cache.keys, QuantizedKV) else cache.keys  # [num_pages, P, 1, R + r]
        if tuple(pool.shape[2:]) != (1, self.row_width) or cache.values.shape[3] != self.kv_lora_rank:
            raise ValueError(f"cache must hold one KV head of {self.row_width} numbers, values the first "
                             f"{self.kv_lora_rank}: got rows {list(pool.shape[2:])}, values {cache.values.shape[3]}")
        self._check_x(x, 2)
        if step is None:
            if cache.layers != 1:
                raise ValueError(f"this cache holds {cache.layers} layers: make the step once "
                                 f"(engine.paged.step.begin_step) and pass step= and layer= to each layer")
            step = begin_step(cache, seqs, indptr, x.shape[0])
        else:
            check_step(step, cache, x.shape[0])
        q_nope, q_pe, rows = self._project(x[None], step.positions[None])  # [1, H, N, n], [1, H, N, r], [1,1,N,R+r]
        cache.write(step.slots, rows[0].transpose(0, 1), None, layer)  # [N, 1, R + r]
        rows_pages, latent_pages = cache.layer(layer)  # [num_pages, P, 1, R + r], [num_pages, P, 1, R]
        q = self._absorbed_query(q_nope, q_pe)[0].transpose(0, 1)  # [N, H, R + r]
        out = step.plan_for(q, rows_pages, latent_pages, scale=self.scale).run(q, rows_pages, latent_pages)  # [N,H,R]
        out = self._values_out(out.transpose(0, 1)[None])  # [1, H, N, v]
        return self.o_proj(merge_heads(out)[0])  # [N, E]

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[B, H, S, n + r]`` and values ``[B, H, S, v]`` of latent rows ``[B, 1, S, R + r]``."""
        latent, k_pe = rows[..., : self.kv_lora_rank], rows[..., self.kv_lora_rank:]  # [B, 1, S, R], [B, 1, S, r]
        kv = split_heads(self.kv_b_proj(latent[:, 0]), self.num_heads)  # [B, H, S, n + v]
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)  # [B, H, S, n], [B, H, S, v]
        return torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1), v  # [B, H, S, n + r]

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[q_nope W_UK | q_pe]`` ``[B, H, T, R + r]``: the query that scores latent rows."""
        w_uk = self._up()[:, : self.nope]  # [H, n, R]
        return torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk), q_pe], dim=-1)  # [B, H, T, R + r]

    def _values_out(self, out_latent: torch.Tensor) -> torch.Tensor:
        """``out_latent [B, H, T, R] W_UV^T``: each head's values ``[B, H, T, v]``."""
        return torch.einsum("bhtr,hvr->bhtv", out_latent, self._up()[:, self.nope:])  # [B, H, T, v]

    def _up(self) -> torch.Tensor:
        """kv_b's weight per head, ``[H, n + v, R]``: W_UK then W_UV."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """``(q_nope [B, H, T, n], q_pe [B, H, T, r], rows [B, 1, T, R + r])`` of ``x [B, T, E]``, RoPE at
        ``positions [B, T]`` on q_pe and the rows' k_pe."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = split_heads(q, self.num_heads).split([self.nope, self.rope], dim=-1)  # [B, H, T, n | r]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)  # [B, T, R | r]
        q_pe = apply_rope(q_pe, positions, self.rope_base, self.rope_pairing)  # [B, H, T, r]
        k_pe = apply_rope(k_pe[:, None], positions, self.rope_base, self.rope_pairing)  # [B, 1, T, r]
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(latent)[:, None], k_pe], dim=-1)  # [B, 1, T, R + r]

    def _check_x(self, x, dims: int) -> None:
        weight = self.kv_a_proj_with_mqa.weight
        if not isinstance(x, torch.Tensor) or x.dim() != dims or x.shape[-1] != weight.shape[1]:
            want = "[B, T, E]" if dims == 3 else "packed tokens [N, E]"
            raise ValueError(f"x must be {want} with E = {weight.shape[1]}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype != weight.dtype or x.device != weight.device:
            raise ValueError(f"x must have the layer's dtype and device ({weight.dtype} on {weight.device}), got "
                             f"{x.dtype} on {x.device}")

    def _check_call(self, x, cache) -> tuple[int, int]:
        self._check_x(x, 3)
        if cache is not None:
            if not isinstance(cache, KVCache) or not cache.shared_values:
                raise ValueError(f"cache must be a latent KVCache (layer.new_cache), got {type(cache).__name__}")
            want = (x.shape[0], 1, self.row_width, self.kv_lora_rank)
            have = (cache.batch_size, cache.kv_heads, cache.keys.shape[-1], cache.values.shape[-1])
            if have != want:
                raise ValueError(f"cache must hold [B, 1, R + r, R] = {list(want)} for this call, got {list(have)}")
        return x.shape[0], x.shape[1]
