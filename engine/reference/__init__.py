"""Oracles, independent of causal_attention and of torch's attention code.

- ``lists``: the attention-from-scratch lesson's program on plain Python lists (standard library only).
- ``loops``: the attention chapter's C++/Rust listing as explicit loops, plus a per-query loop with positions
  and masks.
"""
