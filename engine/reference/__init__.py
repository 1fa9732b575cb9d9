"""Oracles, independent of causal_attention and of torch's attention code.

- ``lists``: seed 002's program on plain Python lists (standard library only).
- ``loops``: seed 000's C++/Rust listing as explicit loops, plus a per-query loop with positions and masks.
"""
