"""Attention kernels. Each takes validated ``AttentionInputs`` (engine.inputs) and returns ``(out, lse)``.

Data flows one way: inputs -> ``dispatch`` (which kernel, and the one fallback order) -> a kernel -> merge.
A kernel is one module with a ``fits`` and a ``run``; it imports building blocks, never another kernel.

Kernels (fastest first), each beside its readable twin, one package per family:
- ``decode.decode_native``: few queries against a (long or quantized) cache in C++, each K/V row read once for its
  query group (twins: decode, tiled; dequantized for a quantized cache); ``decode.native_build`` builds it.
- ``decode.decode``: few queries against a long cache, GQA groups as rows, split-KV merged by log-sum-exp (twin:
  tiled).
- ``sdpa.sdpa``: one call of PyTorch's fused CPU flash op where its semantics fit exactly (twin: reference).
- ``cuda.sdpa_cuda``: PyTorch's fused CUDA attention (flash / cuDNN / efficient) where the rule is one of its two
  patterns; GQA groups folded into rows for decode (twin: reference).
- ``sdpa.sdpa_tiles``: that fused op on the tiles the mask leaves, merged by log-sum-exp (twin: tiled).
- ``flex.flex``: FlexAttention, compiled, on a BlockMask from the mask's tile bounds (``flex.block_mask``), a
  mask_mod from each mask family's rule, softcap as a score_mod; the CUDA kernel for masks and positions,
  forced-only on CPU (twin: tiled).
- ``tiled.tiled``: online softmax over query x key tiles in torch ops, skipping empty tiles; handles everything
  (softcap, Dv != D, per-head masks, NaN/inf, any device) and trains with ``tiled.backward``.
- ``decode.dequantized``: a quantized KV cache dequantised a chunk of keys at a time (twin of decode_native's
  quantized path).
- ``reference``: the dense, materialising path (the seed's listing, made safe); the oracle for the rest.

Building blocks:
- ``visibility``: the rule ``key_pos <= query_pos & allowed`` as one structured mask, decided once per plan;
- ``tiles``: which tiles it leaves (EMPTY / FULL / PARTIAL); ``sdpa.calls``: the fused calls covering them;
- ``sdpa.fused_op``: the fused CPU op, wrapped once; ``sdpa.run_calls``: runs a call plan forward and backward;
- ``scores``, ``dropout``, ``sinks``: score modifiers per block, the dropout pattern, sinks after any kernel;
- ``nonfinite``: NaN/inf in K/V never leak; ``overflow``: room for sums of values near the float max (exact
  power-of-two scaling);
- ``merge``: ``merge_attention_states``; ``common``: compute dtype, GQA rows, empty-row fix-up.
"""

from engine.kernels.dispatch import KERNELS, KernelChoice, SlowPathWarning, select_kernel
from engine.kernels.merge import merge_attention_states

__all__ = ["KERNELS", "KernelChoice", "SlowPathWarning", "select_kernel", "merge_attention_states"]
