"""``run.py bench paged``'s step group: one decode step of SmolLM2-135M's attention shape over a paged cache, planned
once (``engine.plan_paged``) as serving runs it, beside the same keys contiguous (``engine.plan(...).run``) and the
unplanned ``paged_attention`` call, measured interleaved in the same run. The pools hold each page's heads side by
side (``PagedKVCache(heads_outer=False)``'s layout), their pages shuffled.

Hq 9 / Hkv 3 / D 64, B = 8 and 32 sequences of 512 keys each (the same keys both ways) or of 256-768 (ragged: the
contiguous cache holds each row's keys at positions 0..S_b-1 and pads to the longest, as a KVCache does, so its
kernel reads a visibility mask where the paged one stops at each length), pages of 16 and 256 shuffled in the
pool, fp32 / bf16 / int8 (a scale per token and head), 1 and 2 threads. Target: the planned paged step within
1.1x of contiguous.
"""

from __future__ import annotations

from typing import Any

import torch

import engine
from engine import paged_attention, plan_paged
from engine.quantized import quantize
from lab.bench.paged_pools import pools, quantized_pool
from lab.measure import interleaved_us, progress

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention
TARGET = 1.1
PAD_POSITION = 1 << 40  # a padded slot's key position: later than every query, so never seen


def step_rows(args) -> list[dict[str, Any]]:
    cases = [(b, ragged, p, dtype, threads) for b in ((8,) if args.quick else (8, 32)) for ragged in (False, True)
             for p in (16, 256) for dtype in (torch.float32, torch.bfloat16, torch.int8) for threads in (1, 2)]
    rounds, calls = (3, 5) if args.quick else (15, 20)
    g = torch.Generator().manual_seed(args.seed)
    saved = torch.get_num_threads()
    rows = []
    try:
        for batch, ragged, page_size, dtype, threads in progress(cases, "bench paged: step", quiet=args.quiet):
            torch.set_num_threads(threads)
            rows += _step_case(batch, ragged, page_size, dtype, threads, g, rounds, calls)
    finally:
        torch.set_num_threads(saved)
    return rows


def _step_case(batch: int, ragged: bool, page_size: int, dtype: torch.dtype, threads: int, g: torch.Generator,
               rounds: int, calls: int) -> list[dict[str, Any]]:
    quantized = dtype == torch.int8
    float_dtype = torch.float32 if quantized else dtype
    lengths = torch.randint(256, 769, (batch,), generator=g) if ragged else torch.full((batch,), 512)  # [B] keys
    longest = -(-int(lengths.max()) // page_size) * page_size  # the pools' pages cover the longest
    k = torch.randn(batch, HKV, longest, D, generator=g).to(float_dtype)  # [B, Hkv, S, D]
    v = torch.randn(batch, HKV, longest, D, generator=g).to(float_dtype)
    q = torch.randn(batch, HQ, 1, D, generator=g).to(float_dtype)  # [B, Hq, 1, D]
    k_pages, v_pages, table = pools(k, v, page_size, g, True)
    if quantized:  # the same int8 numbers both ways
        k, v, k_pages, v_pages = quantize(k), quantize(v), quantized_pool(k_pages), quantized_pool(v_pages)
    slots = torch.arange(longest)
    key_pos = torch.where(slots < lengths[:, None], slots, PAD_POSITION)  # [B, S]: padding never seen
    query_pos = (lengths - 1)[:, None]  # [B, 1]: each row's query at its last key
    contiguous = engine.plan(q, k, v, query_pos, key_pos) if ragged else engine.plan(q, k, v)  # (uniform: no mask)
    packed, indptr = q[:, :, 0], torch.arange(batch + 1)  # [Nq = B, Hq, D], [B + 1]
    step = plan_paged(packed, k_pages, v_pages, table, lengths, indptr)
    impls = {"contiguous plan.run": lambda: contiguous.run(q, k, v),
             "paged plan.run": lambda: step.run(packed, k_pages, v_pages),
             "paged_attention": lambda: paged_attention(packed, k_pages, v_pages, table, lengths, indptr)}
    want = contiguous.run(q, k, v)[:, :, 0].float()
    diff = max((impls[name]().float() - want).abs().max().item() for name in ("paged plan.run", "paged_attention"))
    us = interleaved_us(impls, rounds, calls, warmup=3)
    rows = []
    for name in impls:
        ratio = us[name] / us["contiguous plan.run"]
        target = name == "paged plan.run"
        rows.append({"group": "step", "case": f"B={batch} S={'256-768' if ragged else 512} page {page_size} "
                     f"{str(dtype)[6:]} {threads}t", "impl": name, "us": us[name], "time/contiguous": ratio,
                     "target": f"<= {TARGET}x" if target else None,
                     "met": ("yes" if ratio <= TARGET else "no") if target else None, "max |diff|": diff,
                     "kernel": step.path if name != "contiguous plan.run" else contiguous.kernel, "B": batch,
                     "page": page_size, "dtype": str(dtype), "threads": threads, "ragged": ragged})
    return rows


CB_TARGET = 1.2


def continuous_rows(args) -> list[dict[str, Any]]:
    """One layer of a continuous-batching decode step (transformers' packed keys; the engine's adapter, its step
    planned by the first layer) beside the same keys contiguous, 32 requests of 256-768 keys, 1 and 2 threads."""
    import engine.integrations.transformers.continuous as continuous  # (needs transformers: the [hf] extra)

    rounds, calls = (3, 3) if args.quick else (21, 10)
    g = torch.Generator().manual_seed(args.seed)
    batch = 8 if args.quick else 32
    lengths = torch.randint(256, 769, (batch,), generator=g)  # [B]
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)  # [B + 1]
    cu_q = torch.arange(batch + 1, dtype=torch.int32)  # one new token each
    key, value = (torch.randn(1, HKV, int(lengths.sum()), D, generator=g) for _ in range(2))  # [1, Hkv, Nk, D]
    query = torch.randn(1, HQ, batch, D, generator=g)  # [1, Hq, Nq, D]
    longest = int(lengths.max())
    k, v = torch.zeros(batch, HKV, longest, D), torch.zeros(batch, HKV, longest, D)  # [B, Hkv, S, D] right-padded
    for b in range(batch):
        k[b, :, :lengths[b]], v[b, :, :lengths[b]] = key[0, :, cu_k[b]:cu_k[b + 1]], value[0, :, cu_k[b]:cu_k[b + 1]]
    slots = torch.arange(longest)
    key_pos = torch.where(slots < lengths[:, None], slots, PAD_POSITION)  # [B, S]
    q = query[0].transpose(0, 1)[:, :, None]  # [B, Hq, 1, D]
    contiguous = engine.plan(q, k, v, (lengths - 1)[:, None], key_pos)
    kwargs = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, read_index=[])
    impls = {"contiguous plan.run": lambda: contiguous.run(q, k, v),
             "continuous batching layer": lambda: continuous.continuous_batch_attention(None, query, key, value,
                                                                                         None, **kwargs)[0]}
    diff = (impls["continuous batching layer"]()[0] - contiguous.run(q, k, v)[:, :, 0]).abs().max().item()
    saved, rows = torch.get_num_threads(), []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            us = interleaved_us(impls, rounds, calls, warmup=3)
            for name in impls:
                ratio = us[name] / us["contiguous plan.run"]
                target = name != "contiguous plan.run"
                rows.append({"group": "continuous", "case": f"{batch} decodes, S=256-768, {threads}t", "impl": name,
                             "us": us[name], "time/contiguous": ratio,
                             "target": f"<= {CB_TARGET}x" if target else None,
                             "met": ("yes" if ratio <= CB_TARGET else "no") if target else None, "max |diff|": diff,
                             "threads": threads})
    finally:
        torch.set_num_threads(saved)
    return rows


MIXED_TARGET = 1.2


def mixed_rows(args) -> list[dict[str, Any]]:
    """A mixed step (two prefill chunks and decodes, SmolLM2's shape, pages of 16): its calls, planned once per step
    (``engine.plan_paged``: each sequence's own call, gathered), beside the same calls on contiguous keys each
    planned once and the unplanned ``paged_attention`` (what every layer ran before the step was planned)."""
    g = torch.Generator().manual_seed(args.seed)
    rounds, calls = (3, 3) if args.quick else (15, 10)
    query_counts = [64, 64] + [1] * (2 if args.quick else 6)  # two chunks of a prefill, then decodes
    lengths = torch.randint(256, 769, (len(query_counts),), generator=g)  # [B] keys, the new ones included
    longest = -(-int(lengths.max()) // 16) * 16
    k, v = (torch.randn(len(query_counts), HKV, longest, D, generator=g) for _ in range(2))  # [B, Hkv, S, D]
    k_pages, v_pages, table = pools(k, v, 16, g, True)
    indptr = torch.tensor([0, *query_counts]).cumsum(0)  # [B + 1]
    packed = torch.randn(int(indptr[-1]), HQ, D, generator=g)  # [Nq, Hq, D]
    per_request = []  # (rows, q [1, Hq, T, D], k, v, plan): each request's call on its contiguous keys
    for b, (count, length) in enumerate(zip(query_counts, lengths.tolist())):
        rows = slice(int(indptr[b]), int(indptr[b + 1]))
        q_b, pos = packed[rows].transpose(0, 1)[None], torch.arange(length - count, length)
        k_b, v_b = k[b:b + 1, :, :length], v[b:b + 1, :, :length]
        per_request.append((rows, q_b, k_b, v_b, engine.plan(q_b, k_b, v_b, pos, torch.arange(length))))
    step = plan_paged(packed, k_pages, v_pages, table, lengths, indptr)

    def contiguous():
        out = packed.new_empty(packed.shape)
        for rows, q_b, k_b, v_b, plan in per_request:
            out[rows] = plan.run(q_b, k_b, v_b)[0].transpose(0, 1)
        return out

    impls = {"contiguous plan.run": contiguous, "paged plan.run": lambda: step.run(packed, k_pages, v_pages),
             "paged_attention": lambda: paged_attention(packed, k_pages, v_pages, table, lengths, indptr)}
    want = contiguous()
    diff = max((impls[name]() - want).abs().max().item() for name in ("paged plan.run", "paged_attention"))
    us = interleaved_us(impls, rounds, calls, warmup=3)
    case = f"{query_counts.count(64)} chunks of 64 + {query_counts.count(1)} decodes, S=256-768, page 16"
    return [{"group": "mixed", "case": case, "impl": name, "us": us[name],
             "time/contiguous": us[name] / us["contiguous plan.run"], "kernel": step.path,
             "target": f"<= {MIXED_TARGET}x" if name == "paged plan.run" else None,
             "met": (("yes" if us[name] / us["contiguous plan.run"] <= MIXED_TARGET else "no")
                     if name == "paged plan.run" else None), "max |diff|": diff} for name in impls]


def invariant_rows(args) -> list[dict[str, Any]]:
    """What batch-invariant mode costs (``engine.set_batch_invariant``): a causal prefill of S queries (and a decode
    step against S keys) planned in the default mode and in batch-invariant mode, timed interleaved."""
    g = torch.Generator().manual_seed(args.seed)
    rounds, calls = (3, 2) if args.quick else (7, 3)
    cases = [(t, s, dtype) for s in ((512,) if args.quick else (512, 2048)) for t in (1, s)
             for dtype in (torch.float32, torch.bfloat16)]
    rows = []
    for t, s, dtype in progress(cases, "bench paged: invariant", quiet=args.quiet):
        q = torch.randn(1, HQ, t, D, generator=g).to(dtype)
        k, v = (torch.randn(1, HKV, s, D, generator=g).to(dtype) for _ in range(2))
        qpos, kpos = torch.arange(s - t, s), torch.arange(s)
        default = engine.plan(q, k, v, qpos, kpos)
        previous = engine.set_batch_invariant(True)
        try:
            invariant = engine.plan(q, k, v, qpos, kpos)
        finally:
            engine.set_batch_invariant(previous)
        impls = {name: (lambda p=p, q=q, k=k, v=v: p.run(q, k, v))
                 for name, p in (("default", default), ("batch-invariant", invariant))}
        diff = (impls["default"]().float() - impls["batch-invariant"]().float()).abs().max().item()
        us = interleaved_us(impls, rounds, calls, warmup=1)
        for name, plan in (("default", default), ("batch-invariant", invariant)):
            rows.append({"group": "invariant", "case": f"{'decode' if t == 1 else 'prefill'} T={t} S={s} "
                         f"{str(dtype)[6:]}", "impl": name, "kernel": plan.kernel, "us": us[name],
                         "time/contiguous": us[name] / us["default"], "target": None, "met": None,
                         "max |diff|": diff})
    return rows
