"""Kernel ``decode_native``: the decode kernel in C++, at the memory-bandwidth limit of the CPU.

Decode reads the whole KV cache for a few queries, so its time is the cache's bytes over the memory bandwidth. This
kernel (``decode_native.cpp``, built by ``native_build``) reads each K/V row once for all ``R = G * T`` query rows of
its KV head, converts it to fp32 in registers (bf16, fp16, int8, fp8), computes the R scores, updates an online
softmax and adds the R weighted rows, in blocks of 64 keys (AVX-512, AVX2, NEON or portable C++: ``vector_path``); each
sequence's keys are cut into work items at multiples of 2,048 positions (``SPLIT`` in the source), shared out to
the threads and merged by log-sum-exp in order, so a row's result depends on its own keys alone: bitwise the same
whatever else shares the batch, however many threads run it, contiguous or paged (batch invariance)::

    q [B, Hq, T, D] -> rows [B, Hkv, G*T, D] * scale     (fp32 or bf16, as q; rows g*T + i: query i of head h*G + g)
    k, v [B, Hkv, S, D] as they are (any strides, last axis contiguous; KVCache.view() slices: no copy)
    out [B, Hkv, G*T, Dv] (fp32 or bf16), lse fp32 [B, Hkv, G*T]  ->  [B, Hq, T, Dv] in q's dtype, [B, Hq, T]

Visibility (positions, windows, padding, documents) is cut to the span of keys some row sees; inside it a bool
``[B|1, Hkv|1, G*T, n]`` tells the kernel which rows see which key (no mask when every key is visible: a decode step).
K/V may be ``QuantizedKV`` (int8 / fp8 with per-token scales, ``engine.quantized``): the option ``"quantized_kv"``.
Fits: T <= 16 on the CPU (any T with key_indices read in place: native_listed), no gradients, fp32 / bf16 / fp16 q; a
softcap caps each score in C++ (``cap * tanh(s / cap)``, off the AMX-BF16 tiles); NaN/inf in q goes to the next kernel.
Readable twins: ``decode`` and ``tiled`` (``dequantized`` for quantized K/V), checked against a float64 oracle.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.inputs import AttentionInputs
from engine.invariance import is_batch_invariant
from engine.kernels.common import MAX_DECODE_QUERIES, DoesNotFit, fold_groups, needs_grad, unfold_groups
from engine.kernels.decode.native_build import load_native, native_unavailable
from engine.kernels.decode.native_library import NON_FINITE_Q, OK, DecodeCall
from engine.kernels.decode.native_listed import listed_fits, listed_runner
from engine.kernels.decode.native_scores import ScoreOps, scores_fit, scores_unread
from engine.kernels.visibility import chunk_rows, decode_rows
from engine.masks.key_indices import split_listed
from engine.quantized import QuantizedKV

MAX_QUERIES = MAX_DECODE_QUERIES  # (engine.kernels.common: one limit for every decode path)

# The element kinds of decode_native.cpp.
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
if hasattr(torch, "float8_e4m3fn"):
    KINDS[torch.float8_e4m3fn] = 4
IO_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # q read and out written in (io_kind); other q converted to fp32


def native_decode_fits(inputs: AttentionInputs) -> str | None:
    """Why the native decode kernel cannot compute these inputs exactly (None: it can). Builds nothing."""
    why_not = native_unavailable()
    if why_not is not None:
        return why_not
    q, k = inputs.q, inputs.k
    if q.shape[2] > MAX_QUERIES and not is_batch_invariant() and listed_fits(inputs) is not None:
        return (f"T = {q.shape[2]} queries: decode serves T <= {MAX_QUERIES} (any T with key_indices it reads in "
                f"place, or in batch-invariant mode)")
    if q.device.type != "cpu":
        return f"the native kernel runs on the CPU, got device {q.device}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{q.dtype}: the native kernel computes in fp32 (fp64 runs the torch kernels)"
    if needs_grad(q, inputs.k, inputs.v):
        return "gradients are needed: training runs the tiled kernels"
    if isinstance(k, QuantizedKV) != isinstance(inputs.v, QuantizedKV):
        return "k and v must both be QuantizedKV or both tensors"
    return scores_fit(inputs)  # (ALiBi: where it can add it)


def native_decode_pays_off(inputs: AttentionInputs) -> str | None:
    """Why ``auto`` would not pick it for inputs it fits: only for top-k keys (``key_indices``) of more than
    MAX_QUERIES queries it cannot read in place (batch-invariant mode: the sparse kernel gathers them). Planned once,
    a call costs the kernel's work plus a few microseconds (measured: 0.4-0.5x SDPA's time from S = 128 to 1024,
    ``run.py bench overhead``), and it checks q and K for NaN/inf as it reads them, where the torch kernels pay a
    pass over K first; with key_indices it reads only the listed keys (native_listed, ``run.py bench sparse``: a
    decode step at S 32k, K 2k 1.46x a dense decode over K keys; a 4k-query prefill 330 ms where the sparse kernel
    took 3.3 s and SDPA with the dense mask 3.1 s)."""
    if inputs.q.shape[2] > MAX_QUERIES and split_listed(inputs.allowed)[0] is not None:
        why_not = listed_fits(inputs)
        if why_not is not None:
            return (f"key_indices for T = {inputs.q.shape[2]} > {MAX_QUERIES} queries not read in place "
                    f"({why_not}): the sparse kernel gathers them")
    return None


def native_decode_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"decode_native"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] fp32 or None)``.
    Dispatch only runs it where ``native_decode_fits`` said yes; the library is built here on first use."""
    return native_decode_runner(inputs)(inputs.q, inputs.k, inputs.v, return_lse)


def native_decode_runner(inputs: AttentionInputs):
    """The kernel for a plan: ``run(q, k, v, return_lse) -> (out, lse)`` with everything that depends on shapes,
    positions and masks decided here, once (the span of keys some row sees, each row's visibility, the ``DecodeCall``
    descriptor). Raises DoesNotFit where the library cannot be built; ``run`` raises it for NaN/inf in q."""
    return inputs.decided("native_runner", lambda: _runner(inputs))


def _runner(inputs: AttentionInputs):
    library = load_native()
    if isinstance(library, str):
        raise DoesNotFit(library)
    if (why_not := scores_unread(library, inputs)) is not None:
        raise DoesNotFit(why_not)
    (batch, q_heads, t, d), kv_heads, dv = inputs.q.shape, inputs.k.shape[1], inputs.v.shape[3]
    resume = "dequantized" if isinstance(inputs.k, QuantizedKV) else "tiled"  # the kernel that handles NaN in q
    listed = listed_runner(library, inputs, resume, paged_template, paged_run)
    if listed is not None:  # top-k keys: only those read, any T
        return listed
    if t <= MAX_QUERIES:  # (every decode step: one kernel call, views only)
        return _chunk_runner(library, inputs, inputs.q.shape, kv_heads, dv, resume, *decode_rows(inputs))
    # batch-invariant mode: MAX_QUERIES queries at a time, each chunk its own span and visibility
    runs = [(i0, i1, _chunk_runner(library, inputs, (batch, q_heads, i1 - i0, d), kv_heads, dv, resume,
                                   *chunk_rows(inputs, i0, i1), i0=i0))
            for i0, i1 in ((i0, min(t, i0 + MAX_QUERIES)) for i0 in range(0, t, MAX_QUERIES))]

    def run(q, k, v, return_lse: bool):
        parts = [chunk(q[:, :, i0:i1], k, v, return_lse) for i0, i1, chunk in runs]
        out = torch.cat([o for o, _ in parts], 2)
        return out, (torch.cat([x for _, x in parts], 2) if return_lse else None)

    return run


def _chunk_runner(library, inputs: AttentionInputs, q_shape: tuple, kv_heads: int, dv: int, resume: str, j0: int,
                  j1: int, visible, i0: int = 0):
    """``run(q, k, v, return_lse)`` for queries ``q`` of shape ``q_shape`` (at most MAX_QUERIES, the call's from i0)
    seeing keys j0 .. j1-1 as ``visible`` says, its softcap and ALiBi (``ScoreOps``): one kernel call, shapes read
    once (``_fold_shapes``); q and out fp32 or bf16 (IO_KINDS), others converted."""
    folded, unfolded = _fold_shapes(tuple(q_shape), kv_heads, dv)
    scale, scores = inputs.scale, ScoreOps(inputs, i0, i0 + q_shape[2], j0, j1)
    planned = []  # the DecodeCall, made by the first run (from its strides), and that run's q layout: its strides
    # unfolded and folded (a q laid out as it was is read through the folded strides, no view made: a view costs
    # about 65 us of a call that finds the CPU's caches cold)

    def run(q, k, v, return_lse: bool):
        io = q.dtype if q.dtype in IO_KINDS else torch.float32
        out = torch.empty(*unfolded, dtype=io)  # written whole by the kernel
        lse = torch.empty(*unfolded[:3]) if return_lse else None  # (None: the kernel writes none)
        if j1 > j0:
            q_in = q if q.dtype == io else q.float()  # (scaled in C++)
            keys, values = _keys(k, j0, j1), _keys(v, j0, j1)
            if not planned:
                q_rows = _rows(q_in.reshape(*folded))
                viewed = q_rows.data_ptr() == q_in.data_ptr()  # (else a copy: every run folds its q)
                planned.extend((_template(scale, q_rows, keys, values, visible, key_offset=j0, scores=scores),
                                q_in.stride() if viewed else None, q_rows.stride()))
            q_strides = q_in.stride()
            if q_strides == planned[1]:  # (the fold of this layout is a view with these strides)
                q_ptr, q_strides = q_in.data_ptr(), planned[2]
            else:
                q_rows = _rows(q_in.reshape(*folded))
                q_ptr, q_strides = q_rows.data_ptr(), q_rows.stride()
            if _run_at(library, planned[0], q_ptr, q_strides, keys, values, out, lse) == NON_FINITE_Q:
                raise DoesNotFit("NaN/inf in q: the torch kernels keep it to the rows it belongs to", resume=resume)
        else:  # no row sees any key
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        return (out if io == q.dtype else out.to(q.dtype)), lse

    return run


@functools.lru_cache(maxsize=256)
def _fold_shapes(q_shape: tuple, kv_heads: int, dv: int) -> tuple[tuple, tuple]:
    """``(folded, unfolded)``: q's rows ``[B, Hkv, G*T, D]``, out ``[B, Hq, T, Dv]``, read off fold_groups /
    unfold_groups (the fold's one definition) once per shape. The kernel's out ``[B, Hkv, G*T, Dv]`` and lse are the
    bytes of unfold_groups' ``[B, Hq, T, Dv]`` / ``[B, Hq, T]``: allocated in those shapes, no view per run."""
    folded = tuple(fold_groups(torch.empty(q_shape, device="meta"), kv_heads).shape)  # [B, Hkv, G*T, D]
    return folded, tuple(unfold_groups(torch.empty((*folded[:3], dv), device="meta"), q_shape[1]).shape)


def _keys(x: torch.Tensor | QuantizedKV, j0: int, j1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(entries [B, Hkv, n, E] (a contiguous last axis), scales [B, Hkv, n] or None)`` of keys j0 .. j1-1."""
    whole = j0 == 0 and j1 == x.shape[2]
    if isinstance(x, QuantizedKV):
        data, scale = (x.data, x.scale) if whole else (x.data[:, :, j0:j1], x.scale[:, :, j0:j1])
    else:
        data, scale = (x if whole else x[:, :, j0:j1]), None
    if data.stride(-1) != 1 and data.shape[-1] > 1:
        data = data.contiguous()  # a strided last axis (x[..., ::2]): the one layout that is copied
    return data, scale


def _template(scale: float, q_rows, keys, values, visible, key_offset: int = 0,
              scores: ScoreOps | None = None) -> tuple[DecodeCall, tuple, ScoreOps | None]:
    """The plan's ``DecodeCall`` (every field but the addresses), the strides it was filled for and ``scores``;
    ``key_offset``: the span's first key in its row, so the kernel cuts its work as for the whole row (invariance)."""
    k_data, v_data = keys[0], values[0]
    if k_data.dtype not in KINDS or v_data.dtype != k_data.dtype:
        raise DoesNotFit(f"K/V dtypes {k_data.dtype}, {v_data.dtype}: not read by the native kernel")
    batch, kv_heads, rows, d = q_rows.shape
    call = DecodeCall(kind=KINDS[k_data.dtype], B=batch, H=kv_heads, R=rows, S=k_data.shape[2], D=d,
                      Dv=v_data.shape[3], scale=scale, key_offset=key_offset, io_kind=IO_KINDS[q_rows.dtype],
                      rows_alone=is_batch_invariant())
    strides = _fill_strides(call, q_rows.stride(), keys, values)
    _set_visible(call, visible)  # (the visibility tensor is the plan's: it outlives every run)
    if scores is not None:
        scores.fill(call)
    return call, strides, (scores if scores is not None and scores.per_run else None)


def _set_visible(call: DecodeCall, visible: torch.Tensor | None) -> None:
    """``visible`` bool ``[B|1, Hkv|1, R, S]`` as the kernel reads it: broadcast with zero strides, read as bytes."""
    if visible is not None:
        vis = visible.expand(call.B, call.H, call.R, call.S).view(torch.uint8)
        call.visible, call.visible_strides[:] = vis.data_ptr(), vis.stride()


def _decode(library, call: DecodeCall) -> int:
    """Run one filled ``DecodeCall``; its status (OK, or NON_FINITE_Q: nothing written)."""
    if (status := library.decode(ctypes.byref(call))) not in (OK, NON_FINITE_Q):
        raise DoesNotFit(f"the native kernel refused the call (status {status})")
    return status


def _fill_strides(call: DecodeCall, q_strides: tuple, keys, values) -> tuple:
    (k_data, k_scale), (v_data, v_scale) = keys, values
    call.k_strides[:], call.v_strides[:], call.q_strides[:] = k_data.stride()[:3], v_data.stride()[:3], q_strides[:3]
    if k_scale is not None:
        call.k_scale_strides[:], call.v_scale_strides[:] = k_scale.stride(), v_scale.stride()
    return _strides_of(q_strides, keys, values)


def _strides_of(q_strides: tuple, keys, values) -> tuple:
    return (q_strides, keys[0].stride(), values[0].stride(), None if keys[1] is None else keys[1].stride(),
            None if values[1] is None else values[1].stride())


def _rows(q_rows: torch.Tensor) -> torch.Tensor:
    """q's rows ``[B, Hkv, R, D]`` with a unit stride on D (the one layout the kernel needs of q)."""
    return q_rows.contiguous() if q_rows.stride(-1) != 1 and q_rows.shape[-1] > 1 else q_rows


def _run(library, template, q_rows, keys, values, out, lse) -> int:
    """One kernel call, the plan's ``DecodeCall`` copied with this run's addresses (strides where they differ)."""
    q_rows = _rows(q_rows)
    return _run_at(library, template, q_rows.data_ptr(), q_rows.stride(), keys, values, out, lse)


def _run_at(library, template, q_ptr: int, q_strides: tuple, keys, values, out, lse) -> int:
    """``_run`` with q's rows given as their address and strides (``[B, Hkv, R, D]``, a unit stride on D)."""
    (k_data, k_scale), (v_data, v_scale) = keys, values
    planned, strides, scores = template
    call = DecodeCall.from_buffer_copy(planned)
    held = None if scores is None else scores.read(call)  # noqa: F841  (slopes, a bias: read now, kept through the call)
    if (q_strides != strides[0] or k_data.stride() != strides[1] or v_data.stride() != strides[2]
            or (k_scale is not None and _strides_of(q_strides, keys, values) != strides)):
        _fill_strides(call, q_strides, keys, values)
    call.threads = torch.get_num_threads()
    call.q, call.k, call.v, call.out, call.lse = (q_ptr, k_data.data_ptr(), v_data.data_ptr(), out.data_ptr(),
                                                  None if lse is None else lse.data_ptr())
    if k_scale is not None:
        call.k_scale, call.v_scale = k_scale.data_ptr(), v_scale.data_ptr()
    return _decode(library, call)


def _call(library, q_rows, scale, keys, values, visible, out, lse, scores: ScoreOps | None = None) -> int:
    """One call with nothing planned (the tests build other vector paths and call them through this)."""
    return _run(library, _template(scale, q_rows, keys, values, visible, scores=scores), q_rows, keys, values, out, lse)


def paged_template(kind: torch.dtype, q_shape: tuple, dv: int, scale: float, pages: torch.Tensor,
                   lengths: torch.Tensor, page_size: int, visible: torch.Tensor | None,
                   softcap: float | None = None) -> DecodeCall:
    """The ``DecodeCall`` of a paged decode step, all but the tensors' addresses (once per step: native_paged): q rows
    ``[B, Hkv, R, D]`` of shape ``q_shape``, pools of dtype ``kind``, pages int64 ``[B, max_pages]`` and lengths int64
    ``[B]`` (contiguous, on the CPU, outliving every run), visible bool ``[B, Hkv|1, R, S]`` or None (every key up to
    each sequence's length). DoesNotFit for a dtype the kernel does not read."""
    if kind not in KINDS:
        raise DoesNotFit(f"page dtype {kind}: not read in place by the native kernel")
    (batch, kv_heads, rows, d), longest = q_shape, (int(lengths.max()) if lengths.numel() else 0)
    call = DecodeCall(kind=KINDS[kind], B=batch, H=kv_heads, R=rows, S=longest, D=d, Dv=dv, scale=scale,
                      pages=pages.data_ptr(), pages_stride=pages.stride(0), page_size=page_size,
                      lengths=lengths.data_ptr(), rows_alone=is_batch_invariant(), softcap=softcap or 0.0)
    _set_visible(call, visible)
    return call


def paged_run(library, template: DecodeCall, q_rows: torch.Tensor, k_pages, v_pages, out: torch.Tensor,
              lse: torch.Tensor | None, scores: ScoreOps | None = None) -> int:
    """One layer of a planned paged step: ``template`` (``paged_template``) with this layer's addresses and strides:
    q_rows ``[B, Hkv, R, D]`` and out ``[B, Hkv, R, Dv]`` both fp32 or both bf16 (IO_KINDS), pools ``[num_pages,
    page_size, Hkv, D | Dv]`` (fp32 / bf16 / fp16, or QuantizedKV: int8 / fp8 with scales ``[num_pages, page_size,
    Hkv]``; unit stride on the last axis), lse fp32 ``[B, Hkv, R]`` or None; ``scores``: ALiBi's slopes read now.
    Returns the kernel's status (OK, or NON_FINITE_Q: nothing written)."""
    call = DecodeCall.from_buffer_copy(template)
    held = None if scores is None else scores.read(call)  # noqa: F841  (kept through the call)
    call.threads = torch.get_num_threads()
    if type(k_pages) is QuantizedKV:  # the pools' scales [num_pages, page_size, Hkv]: (page, slot, head)
        call.k_scale, call.k_scale_strides[:] = k_pages.scale.data_ptr(), k_pages.scale.stride()
        call.v_scale, call.v_scale_strides[:] = v_pages.scale.data_ptr(), v_pages.scale.stride()
        k_pages, v_pages = k_pages.data, v_pages.data
    call.k, call.k_strides[:] = k_pages.data_ptr(), k_pages.stride()[:3]
    call.v, call.v_strides[:] = v_pages.data_ptr(), v_pages.stride()[:3]
    call.q, call.q_strides[:], call.io_kind = q_rows.data_ptr(), q_rows.stride()[:3], IO_KINDS[q_rows.dtype]
    assert out.dtype == q_rows.dtype, f"out {out.dtype} for q rows {q_rows.dtype}: the kernel writes q's kind"
    call.out, call.lse = out.data_ptr(), None if lse is None else lse.data_ptr()
    return _decode(library, call)
