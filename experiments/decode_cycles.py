"""The native decode kernel's compute ceiling: CPU cycles per key, by element kind and vector path.

Decode's target is the memory bandwidth, so the kernel must compute faster than memory delivers. This measures
the compute alone: one KV head whose K/V stay in cache (S = 2,048, D = 128, G = 4 query rows), one thread,
thread CPU time (so other work on a shared machine does not count), the per-call cost removed by subtracting a
run 8x shorter. Each vector path is built with its own flags (this CPU's widest, AVX2 + FMA + F16C, plain C++).

    python experiments/decode_cycles.py [--ghz 2.6]

Cycles are CPU seconds x ``--ghz`` (the nominal clock; turbo makes the true count higher). Bytes per key:
fp32 1,024, bf16/fp16 512, int8/fp8 256 + 8 of scales (K and V); the ceiling in GB/s of K/V for one core is
bytes / (cycles / GHz).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels.decode import native_build  # noqa: E402
from engine.kernels.decode.decode_native import KINDS, _call  # noqa: E402
from engine.quantized import QUANTIZED_DTYPES, quantize  # noqa: E402
from lab.measure import format_table  # noqa: E402

PLAIN = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread")
BUILDS = {"native (-march=native)": PLAIN + ("-march=native",), "avx2": PLAIN + ("-mavx2", "-mfma", "-mf16c"),
          "plain C++": PLAIN}


def operands(kind: torch.dtype, s: int, d: int = 128):
    k, v = torch.randn(1, 1, s, d), torch.randn(1, 1, s, d)
    if kind in QUANTIZED_DTYPES:
        kq, vq = quantize(k, kind), quantize(v, kind)
        return (kq.data, kq.scale), (vq.data, vq.scale), (kq.nbytes + vq.nbytes) // s
    return (k.to(kind), None), (v.to(kind), None), 2 * d * k.to(kind).element_size()


def cpu_seconds_per_call(library, q, k, v, calls: int = 100) -> float:
    out, lse = torch.zeros(1, 1, q.shape[2], v[0].shape[-1]), torch.zeros(1, 1, q.shape[2])
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(calls):
            _call(library, q, k, v, None, out, lse)
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ghz", type=float, default=2.6, help="clock used to turn CPU seconds into cycles")
    parser.add_argument("--keys", type=int, default=2048, help="keys per call (K/V stay in cache)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cxx = native_build.compiler()
    if cxx is None:
        print("no C++ compiler: nothing to measure")
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {}
        for name, flags in BUILDS.items():
            path = Path(tmp) / f"{len(libraries)}.so"
            native_build._build(cxx, path, flags)
            libraries[name] = native_build.NativeLibrary(path, 0.0)
        q = torch.randn(1, 1, 4, 128)  # G = 4 query rows of one KV head
        for kind in KINDS:
            (k, v, bytes_per_key), (k_small, v_small, _) = operands(kind, args.keys), operands(kind, args.keys // 8)
            row = {"kind": str(kind).removeprefix("torch."), "bytes/key": bytes_per_key}
            for name, library in libraries.items():
                long = cpu_seconds_per_call(library, q, k, v)
                short = cpu_seconds_per_call(library, q, k_small, v_small)
                cycles = (long - short) / (args.keys - args.keys // 8) * args.ghz * 1e9
                row[f"{name} cycles/key"] = cycles
                row[f"{name} GB/s/core"] = bytes_per_key * args.ghz / cycles
            rows.append(row)
    model = next((part.split(": ", 1)[1] for part in native_build.cpu_key().split(" | ") if "model name" in part), "?")
    print(f"lanes: {', '.join(f'{n} {lib.lanes}' for n, lib in libraries.items())}; CPU: {model}")
    print(format_table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
