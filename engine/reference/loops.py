"""Explicit loops, no tensor broadcasting: the attention chapter's C++/Rust listing and a general per-query
oracle."""

from __future__ import annotations

import math

import torch


def seed_loop_attention(q: list[float], k: list[float], v: list[float], t: int, s: int,
                        q_heads: int, kv_heads: int, d: int) -> list[float]:
    """The attention chapter's C++/Rust listing, one sequence, flat row-major lists.

    q ``[T, Hq*D]`` for positions ``S-T .. S-1``; k, v ``[S, Hkv*D]``. Query i sees keys ``0 .. S-T+i``;
    query head h reads KV head ``h // (Hq // Hkv)``. Returns ``[T, Hq*D]`` flat.
    """
    if q_heads % kv_heads:
        raise ValueError(f"Query heads ({q_heads}) must be a multiple of KV heads ({kv_heads})")
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(d)
    out = [0.0] * (t * q_heads * d)
    for i in range(t):
        visible = s - t + i + 1  # keys 0 ..= S-T+i
        for h in range(q_heads):
            kvh = h // group
            qv = q[(i * q_heads + h) * d:(i * q_heads + h + 1) * d]
            scores = []
            for j in range(max(visible, 0)):
                kv = k[(j * kv_heads + kvh) * d:(j * kv_heads + kvh + 1) * d]
                scores.append(sum(a * b for a, b in zip(qv, kv)) * scale)
            if not scores:
                continue  # no visible key: the output stays 0
            m = max(scores)
            e = [math.exp(x - m) for x in scores]
            total = sum(e)
            for j, ej in enumerate(e):
                vv = v[(j * kv_heads + kvh) * d:(j * kv_heads + kvh + 1) * d]
                for c in range(d):
                    out[(i * q_heads + h) * d + c] += ej / total * vv[c]
    return out


def per_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        query_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                        allowed: torch.Tensor | None = None, scale: float | None = None,
                        causal: bool = True, softcap: float | None = None) -> torch.Tensor:
    """The oracle for the tests: a loop over (batch, query head, query), in float64.

    Same arguments as causal_attention; only visible keys are ever read, so masked NaN cannot leak.
    Returns ``[B, Hq, T, Dv]`` float64.
    """
    batch, q_heads, t, d = q.shape
    kv_heads, s, dv = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    query_pos = torch.arange(s - t, s) if query_positions is None else query_positions
    key_pos = torch.arange(s) if key_positions is None else key_positions
    query_pos = query_pos.expand(batch, t) if query_pos.dim() == 1 else query_pos  # [B, T]
    key_pos = key_pos.expand(batch, s) if key_pos.dim() == 1 else key_pos  # [B, S]
    full = None if allowed is None else allowed.expand(batch, q_heads, t, s)  # [B, Hq, T, S]
    out = torch.zeros(batch, q_heads, t, dv, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            kvh = h // group
            for i in range(t):
                keys = [j for j in range(s)
                        if (not causal or key_pos[b, j] <= query_pos[b, i]) and (full is None or full[b, h, i, j])]
                if not keys:
                    continue
                idx = torch.tensor(keys)
                kk = k[b, kvh, idx].double()  # [n, D]
                vv = v[b, kvh, idx].double()  # [n, Dv]
                scores = (kk @ q[b, h, i].double()) * scale  # [n]
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                weights = torch.softmax(scores, dim=0)
                out[b, h, i] = weights @ vv
    return out
