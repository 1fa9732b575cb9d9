"""Kernel ``flex``: PyTorch's FlexAttention (compiled) on the engine's own plan.

One call of ``flex_attention`` with what the engine already knows (engine.kernels.flex.block_mask):

    block_mask   from the visibility mask's tile bounds: empty blocks skipped, full blocks unmasked
    mask_mod     the rule pair by pair: each mask family's ``relate`` on per-row positions / ids / flags
    score_mod    softcap: ``c * tanh(s / c)`` on the scaled score (the engine's order)
    enable_gqa   query head h reads KV head h // G (the engine's convention, and Flex's)
    lse          Flex returns it in natural log, as the engine does; rows that see nothing: out 0, lse -inf

Where it runs (torch 2.13):

    CUDA   compiled (Triton) forward and backward, lse included; few queries take Flex's split-KV decoding
           kernel; fp16/bf16/fp32, head dims >= 16. ``auto`` takes it for every call with a mask, per-row
           positions or softcap.
    CPU    compiled (C++) forward for inference in fp32/bf16/fp16; a call that asks for the lse, or in fp64,
           runs Flex's unfused implementation (exact, but it materialises ``[B, Hq, T, S]`` scores). Flex has
           no CPU backward: training on CPU does not fit (dispatch runs the next kernel). ``auto`` never takes
           it on CPU (``sdpa_tiles`` is faster there); ``kernel="flex"`` forces it.

Compiled kernels are cached by torch.compile (one per mask structure, dtype and, on CPU, shape: about 6 s
each on a CPU; on CUDA the second shape compiles a dynamic-shape kernel for the rest), block masks by
content (engine.kernels.flex.block_mask). NaN/inf in masked K/V would reach the output through ``0 * NaN`` (Flex
multiplies the whole block): engine.kernels.nonfinite zeroes them and marks the rows that do see them.
Readable twin: the ``tiled`` kernel (the same blocks, online softmax in plain torch ops).
"""

from __future__ import annotations

import functools
import warnings

import torch

from engine.inputs import AttentionInputs
from engine.kernels.common import DoesNotFit, compute_dtype, needs_grad
from engine.kernels.flex.block_mask import flex_mask
from engine.kernels.nonfinite import run_guarded

try:
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    _flex_attention = None
try:  # torch >= 2.9 asks for the lse this way (return_lse is deprecated)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

COMPILED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what Flex compiles for CPU (no fp64)
CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_CUDA_HEAD_DIM = 16  # Triton's tl.dot: Flex's CUDA kernel refuses smaller head dims


def flex_fits(inputs: AttentionInputs) -> str | None:
    """Why FlexAttention cannot compute these inputs exactly here (None: it can, given finite values)."""
    if _flex_attention is None:
        return f"this torch ({torch.__version__}) has no FlexAttention (torch >= 2.5)"
    device = inputs.q.device.type
    if device not in ("cpu", "cuda"):
        return f"FlexAttention runs on CPU and CUDA; inputs are on {inputs.q.device}"
    if inputs.q.shape[3] == 0 or inputs.v.shape[3] == 0:
        return "D = 0 or Dv = 0: FlexAttention needs non-empty head dims"
    if device == "cpu" and needs_grad(inputs.q, inputs.k, inputs.v):
        return "gradients on CPU: FlexAttention has no CPU backward (torch 2.13); CUDA trains with it"
    if device == "cuda" and inputs.q.dtype not in CUDA_DTYPES:
        return f"dtype {inputs.q.dtype} on CUDA: the Flex kernel here is run in fp16/bf16/fp32"
    if device == "cuda" and min(inputs.q.shape[3], inputs.v.shape[3]) < MIN_CUDA_HEAD_DIM:
        return (f"D = {inputs.q.shape[3]}, Dv = {inputs.v.shape[3]}: Flex's CUDA kernel needs head dims >= "
                f"{MIN_CUDA_HEAD_DIM} (its tl.dot)")
    return None


def flex_pays_off(inputs: AttentionInputs) -> str | None:
    """Why ``auto`` would not pick flex for inputs it fits (None: it pays off)."""
    if inputs.q.device.type == "cpu":
        return ("on CPU sdpa_tiles is faster (docs/BENCHMARKS.md) and Flex compiles once per shape: "
                "flex runs when forced (kernel='flex')")
    return None


def flex_attention(inputs: AttentionInputs, return_lse: bool = False):
    """Kernel ``"flex"``: ``(out [B, Hq, T, Dv] in q's dtype, lse [B, Hq, T] in the compute dtype or None)``."""
    why_not = flex_fits(inputs)
    if why_not is not None:
        raise DoesNotFit(why_not)
    return run_guarded(inputs, return_lse, _flex_call)


def _flex_call(inputs: AttentionInputs, return_lse: bool):
    """One FlexAttention call: compiled where torch compiles it, Flex's unfused implementation otherwise."""
    q, k, v = inputs.q, inputs.k, inputs.v
    backward = needs_grad(q, k, v)
    if not backward:  # e.g. under no_grad with leaves that require grad: Flex on CPU refuses those as if a
        q, k, v = q.detach(), k.detach(), v.detach()  # backward were coming; none is, so it gets plain tensors
    mask = flex_mask(inputs, backward=backward)
    score_mod = None if inputs.softcap is None else softcap_mod(inputs.softcap)
    compiled = q.device.type == "cuda" or (q.dtype in COMPILED_CPU_DTYPES and not return_lse)
    run = compiled_flex(q.device.type) if compiled else _unfused
    lse_request = {} if not return_lse else {"return_lse": True} if AuxRequest is None else \
        {"return_aux": AuxRequest(lse=True)}
    result = run(q, k, v, score_mod=score_mod, block_mask=mask.block_mask, scale=inputs.scale,
                 enable_gqa=q.shape[1] != k.shape[1], **lse_request)
    if not return_lse:
        return result, None  # [B, Hq, T, Dv]
    out, aux = result
    lse = aux if AuxRequest is None else aux.lse  # [B, Hq, T], natural log
    return out, lse.to(compute_dtype(q.dtype))


@functools.cache
def softcap_mod(softcap: float):
    """``score_mod``: ``softcap * tanh(score / softcap)`` of the scaled score (one function per cap, so
    torch.compile sees the same function on every call with that cap)."""

    def mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return mod


@functools.cache
def compiled_flex(device_type: str):
    """``flex_attention`` compiled once per device type; torch.compile caches a kernel per mask structure,
    dtype and shape behind it. CPU: static shapes (its dynamic-shape kernel does not compile in torch 2.13);
    CUDA: torch's default, a dynamic-shape kernel from the second shape on (a decode loop compiles twice)."""
    return torch.compile(_flex_attention, dynamic=False if device_type == "cpu" else None)


def _unfused(q, k, v, **kwargs):
    """Flex's own unfused implementation (exact, materialises the scores): CPU calls with lse or in fp64."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_attention(q, k, v, **kwargs)
