"""Top-k sparse attention: each query reads only the keys listed for it (engine.masks.key_indices)."""
