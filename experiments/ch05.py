"""Seed 000, stretch exercises 1 and 4, with engine.attention.causal_attention.

1. The six-token causal weight table (x as q, k and v, one head, scale=1.0).
4. Runtime and peak memory of causal_attention at T = 512, 1,024, 2,048, 4,096: the fitted growth
   exponent and the T at which it would stop fitting this machine's memory.

    python experiments/ch05.py [--quick] [--out results/ch05] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention import causal_attention  # noqa: E402
from engine.inputs import prepare_inputs
from engine.kernels.dispatch import select_kernel  # noqa: E402
from engine.seeds import SEED_CAUSAL_TABLE, SIX_TOKENS, WORDS  # noqa: E402
from lab.fitting import fit_power_law, solve_power_law  # noqa: E402
from lab.measure import format_table, median_ms, peak_allocated_bytes, progress, save_results  # noqa: E402
from lab.units import machine_memory_bytes  # noqa: E402


def six_token_table() -> torch.Tensor:
    """Stretch 1: weights ``[6, 6]`` of the six tokens; q = k = x, one head, scale = 1.0.

    The weights are what attention multiplies the values by, so attending over one-hot values
    (``v = I_6``) returns them; attending over ``v = x`` returns the context vectors.
    """
    x = SIX_TOKENS.float()[None, None]  # [1, 1, 6, 3]
    eye = torch.eye(6)[None, None]  # [1, 1, 6, 6]
    return causal_attention(x, x, eye, scale=1.0)[0, 0]  # [6, 6]


def measure(lengths: list[int], heads: int, head_dim: int, kernel: str, repeats: int) -> list[dict]:
    rows = []
    for t in progress(lengths, desc=f"causal_attention kernel={kernel}"):
        q, k, v = (torch.randn(1, heads, t, head_dim) for _ in range(3))  # [1, H, T, D]
        chosen = kernel if kernel != "auto" else select_kernel(prepare_inputs(q, k, v, None, None, None, None))[0]
        ms = median_ms(lambda q=q, k=k, v=v: causal_attention(q, k, v, kernel=kernel), repeats=repeats)
        extra = peak_allocated_bytes(lambda q=q, k=k, v=v: causal_attention(q, k, v, kernel=kernel))
        rows.append({"kernel": kernel, "ran": chosen, "T": t, "median_ms": ms,
                     "peak_extra_MiB": extra / 2**20,
                     "score_matrix_MiB": heads * t * t * 4 / 2**20})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for kernel in sorted({r["kernel"] for r in rows}):
        sub = [r for r in rows if r["kernel"] == kernel]
        ts = [r["T"] for r in sub]
        ax_t.loglog(ts, [r["median_ms"] for r in sub], "o-", label=f"kernel={kernel}")
        ax_m.loglog(ts, [max(r["peak_extra_MiB"], 1e-3) for r in sub], "o-", label=f"kernel={kernel}")
    ts = sorted({r["T"] for r in rows})
    scores = [rows[0]["score_matrix_MiB"] * (t / ts[0]) ** 2 for t in ts]
    ax_m.loglog(ts, scores, "k--", label="the [H, T, T] fp32 score matrix")
    ax_t.set(title="Runtime of causal_attention", xlabel="sequence length T (tokens)", ylabel="median time (ms)")
    ax_m.set(title="Peak extra memory", xlabel="sequence length T (tokens)", ylabel="peak extra allocated memory (MiB)")
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (T = 64..512), for a smoke run")
    parser.add_argument("--out", default="results/ch05", help="folder for ch05.json/.csv and ch05.png")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (B = 1)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size (median reported)")
    args = parser.parse_args(argv)

    print("Stretch 1: six-token causal weights via causal_attention (q = k = v = x, scale = 1.0)")
    table = six_token_table()
    print("          " + " ".join(f"{w:>7}" for w in WORDS))
    mismatches = 0
    for word, row, stated in zip(WORDS, table, SEED_CAUSAL_TABLE):
        print(f"{word:<9} " + " ".join(f"{x:7.3f}" for x in row))
        mismatches += any(abs(float(x) - float(s)) > 1e-3 + 1e-9 for x, s in zip(row, stated.split()))
    print(f"  matches seed 000's table to its last printed digit (+-1): {mismatches == 0}")

    lengths = [64, 128, 256, 512] if args.quick else [512, 1024, 2048, 4096]
    print(f"\nStretch 4: B=1, H={args.heads}, D={args.head_dim}, fp32; T = {lengths}")
    rows = measure(lengths, args.heads, args.head_dim, "reference", args.repeats)
    rows += measure(lengths, args.heads, args.head_dim, "auto", args.repeats)
    print(format_table(rows))

    memory = machine_memory_bytes()
    summary = []
    for kernel in ("reference", "auto"):
        sub = [r for r in rows if r["kernel"] == kernel]
        ts = [r["T"] for r in sub]
        p_time, _ = fit_power_law(ts, [r["median_ms"] for r in sub])
        p_mem, a_mem = fit_power_law(ts, [max(r["peak_extra_MiB"], 1e-3) * 2**20 for r in sub])
        t_limit = solve_power_law(p_mem, a_mem, memory) if p_mem > 0.1 else float("inf")
        summary.append({"kernel": kernel, "time_exponent": p_time, "memory_exponent": p_mem,
                        "T_that_fills_memory": t_limit})
    # The seed's quadratic model: one fp32 score matrix per head, plus its exp and weights copies (x3).
    t_model = math.sqrt(memory / (3 * args.heads * 4))
    print(format_table(summary))
    print(f"machine memory {memory / 2**30:.1f} GiB; the [H, T, T] fp32 scores (x3 live copies) fill it at "
          f"T ~ {t_model:,.0f}")

    out = Path(args.out)
    paths = save_results(out, "ch05", rows + summary, meta={"heads": args.heads, "head_dim": args.head_dim,
                                                              "memory_bytes": memory})
    plot(rows, out / "ch05.png")
    print("saved", *[str(p) for p in paths], out / "ch05.png")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
