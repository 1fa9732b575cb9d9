"""Softmax three ways: stable (subtract the row max), naive (overflows), online (running max and sum).

Fully masked rows (every entry -inf) return zeros, never NaN.
"""

from __future__ import annotations

import torch


def stable_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(s - max) / sum(exp(s - max))``; a row of all ``-inf`` gives zeros."""
    row_max = scores.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)
    denom = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(denom > 0, denom, torch.ones_like(denom))


def naive_softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(s) / sum(exp(s))`` with no max subtraction: overflows to inf/NaN for scores near 100 in fp32."""
    exp = torch.exp(scores)
    return exp / exp.sum(dim=dim, keepdim=True)


def online_softmax(scores: torch.Tensor, block_size: int = 2) -> torch.Tensor:
    """Softmax over the last axis computed block by block with a running max ``m_i`` and sum ``l_i``.

    One pass over the blocks keeps, per row, ``m_i`` = max so far and ``l_i`` = sum of ``exp(s - m_i)``;
    when a block raises the max, the old sum is rescaled by ``exp(m_old - m_new)``. A second pass
    normalises. This is the recurrence FlashAttention uses; here it is shown on its own.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = scores.shape[:-1]
    m_i = torch.full(shape, float("-inf"), dtype=scores.dtype, device=scores.device)  # running max
    l_i = torch.zeros(shape, dtype=scores.dtype, device=scores.device)  # running sum of exp(s - m_i)
    for start in range(0, scores.shape[-1], block_size):
        block = scores[..., start:start + block_size]
        m_new = torch.maximum(m_i, block.amax(dim=-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(m_i - m_safe)  # exp(-inf) = 0 on the first block
        l_i = l_i * rescale + torch.exp(block - m_safe[..., None]).sum(dim=-1)
        m_i = m_new
    m_safe = torch.where(torch.isfinite(m_i), m_i, torch.zeros_like(m_i))
    denom = torch.where(l_i > 0, l_i, torch.ones_like(l_i))
    return torch.exp(scores - m_safe[..., None]) / denom[..., None]
