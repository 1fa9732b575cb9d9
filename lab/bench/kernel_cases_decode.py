"""The decode cases of ``run.py bench kernels``: one new query per row against a long cache (the engine's decode
kernels, SDPA with ``enable_gqa`` and the copy bandwidth; quantized caches), and decode against a KV-cache view."""

from __future__ import annotations

import torch

from engine.attention import causal_attention
from lab.bench.kernel_cases import COPY_BYTES, Case, Impl, _auto, _engine_impls, _qkv, _sdpa


def decode(batch: int, q_heads: int, kv_heads: int, s: int, d: int, dtype: torch.dtype, tiled: bool,
           quantized: bool = False) -> Case:
    """One new query per row against S cached keys (default positions: every key visible): the engine (the
    native kernel), the previous torch ``decode`` kernel forced, SDPA with ``enable_gqa`` and the copy
    bandwidth; ``quantized`` adds the same cache stored in int8 (and fp8 e4m3), read by the engine."""
    def build() -> list[Impl]:
        from engine.quantized import QUANTIZED_DTYPES, quantize

        q, k, v = _qkv(batch, q_heads, kv_heads, 1, s, d, dtype)
        impls = _engine_impls(q, k, v, ("decode",) + (("tiled",) if tiled else ()))
        for kind in QUANTIZED_DTYPES if quantized else ():
            kq, vq = quantize(k, kind), quantize(v, kind)  # [B, Hkv, S, D] 1-byte entries + [B, Hkv, S] scales
            name = "int8" if kind == torch.int8 else "fp8"
            impls.append(Impl(f"engine {name} cache", lambda kq=kq, vq=vq: causal_attention(q, kq, vq),
                              kv_bytes=float(kq.nbytes + vq.nbytes), note="K/V bytes: 1 per entry + fp32 scales"))
        impls.append(Impl("sdpa enable_gqa", _sdpa(q, k, v, False), "peer"))
        src = k.reshape(-1)[: COPY_BYTES // k.element_size()]  # beyond the caches, the size does not matter
        dst = torch.zeros_like(src)  # zeros: its pages are mapped before the timing
        impls.append(Impl("copy", lambda: dst.copy_(src), "bandwidth",
                          note=f"copy bandwidth = (bytes read + written) / s, {src.numel() * src.element_size() >> 20} "
                          "MiB buffer"))
        return impls
    item = torch.finfo(dtype).bits // 8
    kv_bytes = 2.0 * batch * kv_heads * s * d * item
    name = f"B={batch} Hq={q_heads} Hkv={kv_heads} D={d} S={s} {str(dtype).replace('torch.', '')}"
    return Case("decode", name, {"B": batch, "S": s, "dtype": str(dtype)}, build, 4.0 * d * q_heads * batch * s,
                kv_bytes)


def decode_scores(kind: str, batch: int, q_heads: int, kv_heads: int, s: int, d: int, dtype: torch.dtype,
                  cold: bool = True) -> Case:
    """A decode step whose scores a model modifies (group "scores", outside the targets): ``kind`` "softcap" (Gemma
    2's cap of 50), "alibi" (BLOOM's / MPT's slopes, 2^(-8 h / Hq)) or "bias" (a dense ``[1, Hq, 1, S]`` tensor, as
    T5's relative bias reaches attention through transformers). The engine (the native kernel adds each in C++), the
    kernel such decodes ran on before it did (tiled / the torch decode), the engine without the modifier (the
    floor), and as peers transformers' eager steps (scores, the modifier, softmax, values; K/V repeated for the group)
    and, for ALiBi and a bias, SDPA given the biases as its float mask ``[1, Hq, 1, S]``; the softcap and ALiBi also
    as a paged step (``_paged_step``). Each call after the caches are cleared (``cold``; not in the quick suite's
    smoke test, where clearing them would take most of its time)."""
    def build() -> list[Impl]:
        from engine.planning import explain

        q, k, v = _qkv(batch, q_heads, kv_heads, 1, s, d, dtype)
        group = q_heads // kv_heads
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / q_heads) for h in range(q_heads)])
        bias = (slopes[:, None] * (torch.arange(s) - (s - 1)).float())[None, :, None, :].to(dtype)  # [1, Hq, 1, S]
        if kind == "bias":
            bias = torch.randn(1, q_heads, 1, s, generator=torch.Generator().manual_seed(1)).to(dtype)
        options = {"softcap": {"softcap": 50.0}, "alibi": {"alibi_slopes": slopes}, "bias": {"bias": bias}}[kind]
        before = "tiled" if kind == "softcap" else "decode"

        def eager():
            keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, Hq, S, D]
            scores = torch.matmul(q, keys.transpose(2, 3)) * d ** -0.5
            scores = torch.tanh(scores / 50.0) * 50.0 if kind == "softcap" else scores + bias
            return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), values)
        impls = [Impl(f"engine ({explain(q, k, v, **options).kernel})", lambda: causal_attention(q, k, v, **options)),
                 Impl(f"engine:{before}", lambda: causal_attention(q, k, v, kernel=before, **options),
                      note=f"the kernel {kind} decodes ran on before"),
                 Impl(f"engine, no {kind}", lambda: causal_attention(q, k, v), note="the same decode without it"),
                 Impl(f"eager {kind}", eager, "peer", note="transformers' eager attention's steps")]
        if kind != "softcap":
            impls.append(Impl(f"sdpa {kind} mask", lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=True), "peer", note="the biases as a float mask"))
        if kind != "bias":  # (a paged step takes no dense bias)
            impls += _paged_step(q, k, v, kind, options)
        return impls
    kv_bytes = 2.0 * batch * kv_heads * s * d * (torch.finfo(dtype).bits // 8)
    what = {"softcap": "softcap 50", "alibi": "ALiBi", "bias": "a bias"}[kind]
    name = f"{what}, B={batch} Hq={q_heads} Hkv={kv_heads} D={d} S={s} {str(dtype).replace('torch.', '')}"
    return Case("scores", name, {"B": batch, "S": s, "dtype": str(dtype)}, build, 4.0 * d * q_heads * batch * s,
                kv_bytes, cold=cold)  # (each call from memory: warm, a row's time hung on the rows run before it)


def _paged_step(q, k, v, kind: str, options: dict, page: int = 16) -> list[Impl]:
    """The same decode as a paged step (``plan_paged`` once, ``run`` timed): K/V in pools of ``page``-key pages in
    shuffled order, with the modifier and without it."""
    from engine.paged import plan_paged

    batch, kv_heads, s, d = k.shape
    per = -(-s // page)
    table = torch.randperm(batch * per, generator=torch.Generator().manual_seed(2)).reshape(batch, per)  # [B, pages]
    pools = []
    for x in (k, v):
        pool = x.new_zeros(batch * per, page, kv_heads, x.shape[3])  # [pages, page, Hkv, D]
        rows = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, per * page - s))  # [B, per * page, Hkv, D]
        pool[table.reshape(-1)] = rows.reshape(batch * per, page, kv_heads, x.shape[3])
        pools.append(pool)
    packed = q[:, :, 0].contiguous()  # [B, Hq, D]: one query a sequence
    lens, indptr = torch.full((batch,), s), torch.arange(batch + 1)
    plans = {}
    for name, given in ((f"engine paged, pages of {page}", options), (f"engine paged, no {kind}", {})):
        plans[name] = plan_paged(packed, *pools, table, lens, indptr, **given)
        want = causal_attention(q, k, v, **given)[:, :, 0].float()  # [B, Hq, Dv]: the contiguous call's
        if (plans[name].run(packed, *pools).float() - want).abs().max().item() > 1e-2 * (1 + want.abs().max().item()):
            raise RuntimeError(f"{name}: the paged step differs from the same decode on contiguous K/V")
    return [Impl(name, lambda made=made: made.run(packed, *pools), note="plan_paged once, its run timed"
                 if not name.endswith(kind) else "the same paged step without it") for name, made in plans.items()]


def decode_cache_view(batch: int, q_heads: int, kv_heads: int, s: int, capacity: int, d: int) -> Case:
    """Decode against a KV-cache view (group "cache", outside the targets): the cache's filled slots
    ``[B, Hkv, S, D]`` are a strided slice of its ``capacity``-long buffer."""
    def build() -> list[Impl]:
        from engine.kv_cache import KVCache

        q, k, v = _qkv(batch, q_heads, kv_heads, 1, s, d)
        cache = KVCache(batch, kv_heads, capacity, d)
        keys, values, key_positions, _ = cache.update(k, v)  # strided views of the cache
        query_positions = torch.full((batch, 1), s)
        impls = [Impl(f"engine ({_auto(q, keys, values, key_positions=key_positions)})",
                      lambda: causal_attention(q, keys, values, query_positions, key_positions))]
        impls.append(Impl("engine on a contiguous copy", lambda: causal_attention(q, k, v)))
        impls.append(Impl("sdpa enable_gqa", _sdpa(q, keys, values, False), "peer"))
        return impls
    kv_bytes = 2.0 * batch * kv_heads * s * d * 4
    name = f"B={batch} Hq={q_heads} Hkv={kv_heads} D={d} S={s} of {capacity} float32"
    return Case("cache", name, {"S": s}, build, 4.0 * d * q_heads * batch * s, kv_bytes)


def _on_huge_pages(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` in the kind of buffer the engine's KV caches hold (``engine.huge_pages.zeros``)."""
    from engine import huge_pages

    return huge_pages.zeros(*x.shape, dtype=x.dtype).copy_(x)


def _threads(n: int, run):
    """``run`` with torch's intra-op threads set to ``n`` for the call (the kernel runs on torch's OpenMP workers)."""
    def call():
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return run()
        finally:
            torch.set_num_threads(before)
    return call


def _read(*buffers: torch.Tensor) -> list[torch.Tensor]:
    """Every byte of ``buffers`` read once (a sum of their 4-byte words as fp32, whatever they hold): the rate the
    machine reads memory at, on torch's threads, with no attention's arithmetic."""
    return [x.reshape(-1).view(torch.float32).sum() for x in buffers]


def decode_bandwidth(batch: int, s: int, dtype: torch.dtype) -> Case:
    """Group "bandwidth" (Hq 32 / Hkv 8 / D 128, one new query per sequence): the native kernel reading K/V from the
    buffers the engine's caches hold (2 MiB pages where Linux gives them), the same on the caller's plain tensors
    (4 KiB pages), on 2 threads, int8 / fp8 caches (bf16 cases; on 1 and 2 threads), SDPA, the copy bandwidth and
    the read ceiling (the same K/V bytes summed on 1 and 2 threads), all in one run, each call after the caches are
    cleared (``cold``)."""
    def build() -> list[Impl]:
        from engine.quantized import QUANTIZED_DTYPES, QuantizedKV, quantize

        q, k, v = _qkv(batch, 32, 8, 1, s, 128, dtype)
        kc, vc = _on_huge_pages(k), _on_huge_pages(v)
        impls = [Impl(f"engine ({_auto(q, kc, vc)}), cache buffers", lambda: causal_attention(q, kc, vc),
                      note="K/V in engine.huge_pages buffers, as KVCache / PagedKVCache hold them"),
                 Impl("engine, 2 threads", _threads(2, lambda: causal_attention(q, kc, vc))),
                 Impl("engine, caller's tensors", lambda: causal_attention(q, k, v), note="torch.randn's buffers")]
        for kind in QUANTIZED_DTYPES if dtype == torch.bfloat16 else ():
            kq, vq = (QuantizedKV(_on_huge_pages(x.data), _on_huge_pages(x.scale)) for x in (quantize(k, kind),
                                                                                           quantize(v, kind)))
            name = "int8" if kind == torch.int8 else "fp8"
            kv_bytes = float(kq.data.nbytes + kq.scale.nbytes + vq.data.nbytes + vq.scale.nbytes)
            impls.append(Impl(f"engine {name} cache", lambda kq=kq, vq=vq: causal_attention(q, kq, vq),
                              kv_bytes=kv_bytes, note="K/V bytes: 1 per entry + fp32 scales"))
            impls.append(Impl(f"engine {name} cache, 2 threads",
                              _threads(2, lambda kq=kq, vq=vq: causal_attention(q, kq, vq)), kv_bytes=kv_bytes))
        impls.append(Impl("sdpa enable_gqa", _sdpa(q, kc, vc, False), "peer"))
        src = k.reshape(-1)[: COPY_BYTES // k.element_size()]
        dst = torch.zeros_like(src)
        impls.append(Impl("copy", lambda: dst.copy_(src), "bandwidth",
                          note=f"copy bandwidth = (bytes read + written) / s, {src.nbytes >> 20} MiB buffer"))
        for n in (1, 2):
            impls.append(Impl(f"read, {n} thread{'s' * (n > 1)}", _threads(n, lambda: _read(kc, vc)), "read",
                              note="the cache buffers' K/V bytes summed as fp32 words: the machine's read ceiling"))
        return impls
    kv_bytes = 2.0 * batch * 8 * s * 128 * (torch.finfo(dtype).bits // 8)
    name = f"B={batch} Hq=32 Hkv=8 D=128 S={s} {str(dtype).replace('torch.', '')}"
    return Case("bandwidth", name, {"B": batch, "S": s, "dtype": str(dtype)}, build, 4.0 * 128 * 32 * batch * s,
                kv_bytes, cold=True)
