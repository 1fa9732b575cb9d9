"""Attention kernels. Each takes resolved ``AttentionInputs`` and returns ``(out, lse)``.

- ``reference``: the dense, materialising path (the seed's listing, made safe); the oracle for the rest.
- ``tiled``: online softmax over query x key tiles in torch ops, skipping empty tiles; handles everything
  (softcap, Dv != D, per-head masks, NaN/inf, any device) and trains with a tiled backward.
- ``sdpa``: one call of PyTorch's fused CPU flash kernel where its semantics fit exactly.
- ``sdpa_tiles``: that fused kernel on the tiles the mask leaves, merged by log-sum-exp.
- ``decode``: few queries against a long cache, GQA groups as rows, split-KV merged by log-sum-exp.
- ``tiles``: which tiles a mask leaves (empty / full / partial); ``merge``: ``merge_attention_states``.
- ``dispatch``: picks a kernel for the inputs and says why (``explain``).
"""

from engine.kernels.dispatch import KERNELS, KernelChoice, SlowPathWarning, explain, select_kernel
from engine.kernels.merge import merge_attention_states

__all__ = ["KERNELS", "KernelChoice", "SlowPathWarning", "explain", "select_kernel", "merge_attention_states"]
