"""The seeds' worked-example inputs and stated tables, defined once (``run.py attention``, the figures, the
experiments and the tests read them from here)."""

from __future__ import annotations

import torch

SIX_TOKENS = torch.tensor([[0.43, 0.15, 0.89],   # Your
                           [0.55, 0.87, 0.66],   # journey
                           [0.57, 0.85, 0.64],   # starts
                           [0.22, 0.58, 0.33],   # with
                           [0.77, 0.25, 0.10],   # one
                           [0.05, 0.80, 0.55]],  # step
                          dtype=torch.float64)
WORDS = ["Your", "journey", "starts", "with", "one", "step"]
# Seed 000, Step 4: causal weights of the six tokens (plain dot products, scale 1).
SEED_CAUSAL_TABLE = [
    "1.000 0.000 0.000 0.000 0.000 0.000",
    "0.368 0.632 0.000 0.000 0.000 0.000",
    "0.228 0.389 0.382 0.000 0.000 0.000",
    "0.205 0.296 0.292 0.208 0.000 0.000",
    "0.175 0.225 0.227 0.157 0.216 0.000",
    "0.139 0.218 0.213 0.142 0.099 0.190",
]
