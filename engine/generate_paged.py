"""``run.py generate --paged PAGE_SIZE``: the same greedy generation served from a paged KV cache.

Each row's real prompt tokens (no padding) are one sequence of one ``PagedKVCache`` holding every layer's pools (one
page table and allocator for the model); the prefill is one packed call of every prompt, each decode step one packed
call of every sequence's new token (the model's ``forward_paged``: the step made once, its plan shared by the
layers). The greedy tokens must equal the contiguous cache's; the pages held are reported beside the
contiguous cache's reservation. A layer with a sliding window releases the pages wholly behind it as it goes.
"""

from __future__ import annotations

import time

import torch

from engine.paged import PagedKVCache


@torch.no_grad()
def generate_paged(model, ids: torch.Tensor, valid: torch.Tensor, new_tokens: int, page_size: int):
    """Greedy tokens ``[B, new_tokens]`` of the prompts ``ids [B, T]`` (real tokens where ``valid``), the cache and
    the seconds taken: one PagedKVCache for the model (one page table and allocator, pools per layer)."""
    prompts = [row[keep] for row, keep in zip(ids, valid)]  # each row's real tokens
    attn = model.blocks[0].attn
    pages = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts)
    weight = attn.k_proj.weight
    windows = [block.attn.window for block in model.blocks]
    window = None if None in windows else max(windows)  # pages are released only where every layer is done
    cache = PagedKVCache(pages, page_size, attn.num_kv_heads, attn.head_dim, dtype=weight.dtype,
                         device=weight.device, window=window, layers=len(model.blocks))
    seqs = [cache.add() for _ in prompts]
    indptr = torch.tensor([0] + torch.tensor([len(p) for p in prompts]).cumsum(0).tolist())
    start = time.perf_counter()
    logits = model.forward_paged(torch.cat(prompts), cache, seqs, indptr)  # [N, V]
    token = logits[indptr[1:] - 1].argmax(dim=-1)  # [B]: each sequence's last prompt token
    tokens = [token]
    steps = torch.arange(len(prompts) + 1)
    for _ in range(new_tokens - 1):
        token = model.forward_paged(token, cache, seqs, steps).argmax(dim=-1)  # [B]
        tokens.append(token)
    return torch.stack(tokens, dim=1), cache, time.perf_counter() - start


def report_paged(model, ids: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor, new_tokens: int,
                 page_size: int, capacity: int) -> bool:
    """Print the paged run beside the contiguous one; True when the greedy tokens are the same."""
    paged_tokens, cache, seconds = generate_paged(model, ids, valid, new_tokens, page_size)
    same = torch.equal(paged_tokens, tokens)
    held = cache.pages_in_use * page_size
    tokens_held = int(valid.sum()) + ids.shape[0] * (new_tokens - 1)
    print(f"paged (page {page_size}): same greedy tokens as the contiguous cache: {'yes' if same else 'NO'}; "
          f"{ids.shape[0] * new_tokens} tokens in {seconds * 1e3:.1f} ms; per layer {held} slots held for "
          f"{tokens_held} tokens (a contiguous cache reserves {ids.shape[0] * capacity})")
    return same
