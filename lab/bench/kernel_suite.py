"""The suite of ``run.py bench kernels`` on CPU: which cases run, at which sizes, in the order of the targets."""

from __future__ import annotations

import torch

from lab.bench.kernel_cases import (
    Case,
    chunked,
    chunked_bf16,
    documents,
    memory,
    prefill,
    ragged,
    windowed,
)
from lab.bench.kernel_cases_decode import decode, decode_bandwidth, decode_cache_view, decode_scores


def training_cases(quick: bool, heads: int, d: int, flex: bool) -> list[Case]:
    t_plain, t_long = (512, 1024) if quick else (4096, 16384)
    w, doc = (128, 256) if quick else (512, 1024)
    return [prefill(t_plain, heads, d, False, False, train=True),
            windowed(t_long, w, heads, d, False, True, train=True),
            documents(t_long // doc, doc, heads, d, False, train=True)]


def all_cases(quick: bool, flex: bool) -> list[Case]:
    """The benchmark's cases, in the order of its seven targets (fp32, B=1, Hq=16, D=64 unless said)."""
    h, d = 16, 64
    if quick:
        cases = [prefill(t, h, d, flex and t == 1024, t <= 1024) for t in (512, 1024)]
        cases += [chunked(256, 2048, h, d, flex), ragged(256, [512, 1024, 1536, 2048], h, d, False)]
        cases += [windowed(t, 128, h, d, flex and t == 2048, True) for t in (1024, 2048, 4096)]
        cases += [documents(4, 512, h, d, flex)]
        cases += [decode(2, 32, 8, 4096, 128, dt, dt != torch.float16, dt == torch.bfloat16)
                  for dt in (torch.float32, torch.bfloat16, torch.float16)]
        cases += [decode_bandwidth(1, 4096, torch.bfloat16)]
        cases += [memory(4096, h, d)]
        cases += [chunked_bf16(256, 2048, h, d), chunked_bf16(256, 1024, h, d, train=True)]
        cases += [decode_cache_view(1, 32, 8, 4096, 8192, 128)]
        cases += [decode_scores(kind, 1, 8, 4, 1024, 256, torch.bfloat16, cold=False) if kind == "softcap" else
                  decode_scores(kind, 1, 32, 32, 512, 128, torch.bfloat16, cold=False)
                  for kind in ("softcap", "alibi", "bias")]
        return cases + training_cases(True, h, d, flex)
    cases = [prefill(t, h, d, flex and t == 4096, t <= 2048) for t in (1024, 2048, 4096, 8192)]
    cases += [chunked(512, c, h, d, flex and c == 8192) for c in (4096, 8192, 16384)]
    cases += [ragged(512, [4096, 8192, 12288, 16384], h, d, False)]
    cases += [windowed(t, 512, h, d, flex and t == 16384, t <= 16384) for t in (4096, 8192, 16384, 32768)]
    cases += [documents(16, 1024, h, d, flex)]
    cases += [decode(b, 32, 8, s, 128, dt, b == 8 and s == 32768 and dt == torch.float32, dt == torch.bfloat16)
              for b in (1, 8) for s in (4096, 32768, 131072) for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cases += [decode_bandwidth(b, s, dt) for b, s in ((1, 32768), (8, 8192))
              for dt in (torch.float32, torch.bfloat16, torch.float16)]
    cases += [memory(65536, h, d)]
    cases += [chunked_bf16(512, 8192, h, d), chunked_bf16(512, 4096, h, d, train=True)]
    cases += [decode_cache_view(1, 32, 8, 32768, 65536, 128)]
    cases += [decode_scores("softcap", b, 8, 4, s, 256, dt) for b, s in ((1, 4096), (1, 32768), (8, 4096))
              for dt in (torch.float32, torch.bfloat16)]  # Gemma 2 2B's heads
    cases += [decode_scores(kind, b, 32, 32, s, 128, dt) for kind in ("alibi", "bias")
              for b, s in ((1, 4096), (1, 16384), (8, 2048)) for dt in (torch.float32, torch.bfloat16)]  # MPT-7B's
    return cases + training_cases(False, h, d, flex)
