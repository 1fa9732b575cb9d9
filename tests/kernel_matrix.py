"""The kernels the CPU test matrices (tests/test_kernels*.py) run, and the kernels tested in modules of their own.

``flex`` compiles once per shape and mask structure (about 6 s each on 2 CPU cores, and torch.compile keeps 8
per function before it runs Flex unfused): a matrix over dozens of shapes and hypothesis draws would spend
minutes compiling, then test the unfused path. tests/test_kernels_flex.py runs the matrix's cases on it
instead (fp64 and the lse through Flex's unfused path, which shares the mask_mod and score_mod, and a few
compiled fp32 calls), with its own oracle tests. ``sdpa_cuda`` runs on CUDA only: tests/test_kernels_cuda.py
runs the matrix on every kernel there, skipped with its reason where no GPU is present.
"""

from __future__ import annotations

from engine.kernels.dispatch import KERNELS

OWN_MODULES = ("flex", "sdpa_cuda")
MATRIX = [name for name in KERNELS if name not in OWN_MODULES]  # every kernel of the CPU matrices
FAST = [name for name in MATRIX if name != "reference"]  # ... less the oracle
