"""``run.py explain scaling``: why scores are divided by sqrt(d_k), measured against the figures of the
attention chapter and the attention-from-scratch lesson.

1. Spread: q.k of vectors with independent N(0, 1) components has variance d_k, so its standard deviation
   is sqrt(d_k) (the attention-from-scratch lesson's program measures 4.10, 11.47, 31.77 at d_k = 16, 128,
   1024); dividing by sqrt(d_k) brings it back to 1.
2. Saturation: a softmax over scores that spread by ~30 puts almost all weight on one key. The attention
   chapter: softmax([1, 2, 3]) = [0.09, 0.24, 0.67] but softmax([8, 16, 24]) = [0.0000, 0.0003, 0.9997].
3. Gradient: d softmax / d scores = diag(p) - p p^T, which vanishes as p becomes one-hot. Its size (Frobenius
   norm) is measured per row, with and without scaling: without it the typical row's gradient collapses as
   d_k grows, and training through such a softmax stalls.
"""

from __future__ import annotations

import argparse
import math

import torch

from lab import plots
from lab.measure import format_table, save_results
from lab.options import positive_int

HEADLINE_DIMS = (16, 128, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=positive_int, default=2000,
                        help="random query-key pairs (or query rows) per d_k (default 2000, as the "
                        "attention-from-scratch lesson)")
    parser.add_argument("--keys", type=positive_int, default=64, help="keys per softmax row (default 64)")
    parser.add_argument("--max-dim", type=positive_int, default=4096,
                        help="sweep d_k = 4, 8, ... up to this for the plot (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="fewer samples and dims (a smoke test)")
    parser.add_argument("--out", default="results/explain_scaling",
                        help="folder for explain_scaling.json/.csv and .png (default results/explain_scaling)")


def dot_spread(d_k: int, samples: int, generator: torch.Generator) -> float:
    """Root-mean-square of q.k over ``samples`` pairs of N(0, 1) vectors (the mean is 0, so this is the std)."""
    q = torch.randn(samples, d_k, generator=generator, dtype=torch.float64)  # [N, d_k]
    k = torch.randn(samples, d_k, generator=generator, dtype=torch.float64)  # [N, d_k]
    dots = (q * k).sum(-1)  # [N]
    return float(dots.pow(2).mean().sqrt())


def softmax_jacobian(weights: torch.Tensor) -> torch.Tensor:
    """``d p_i / d s_j = p_i (delta_ij - p_j)`` for rows of softmax weights ``[N, S]`` -> ``[N, S, S]``."""
    return torch.diag_embed(weights) - weights[:, :, None] * weights[:, None, :]  # [N, S, S]


def softmax_stats(scores: torch.Tensor) -> dict[str, float]:
    """Saturation and gradient size of the softmax over each row of ``scores`` ``[N, S]``.

    ``saturated``: share of rows whose top key takes more than 99% of the weight. ``grad_median``/``grad_mean``:
    the Frobenius norm of each row's Jacobian (how much the weights can still move when the scores move).
    """
    weights = torch.softmax(scores, dim=-1)  # [N, S]
    top = weights.max(dim=-1).values  # [N]
    size = softmax_jacobian(weights).flatten(1).norm(dim=-1)  # [N]
    return {"max_weight": float(top.mean()), "saturated": float((top > 0.99).float().mean()),
            "grad_median": float(size.median()), "grad_mean": float(size.mean())}


def sweep(dims: list[int], samples: int, keys: int, seed: int) -> list[dict]:
    """One row per d_k: spread before/after scaling, and softmax statistics without and with the division.

    Each softmax row is one random query against the same ``keys`` random keys (fresh keys for every d_k).
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for d_k in dims:
        spread = dot_spread(d_k, samples, generator)
        q = torch.randn(samples, d_k, generator=generator, dtype=torch.float64)  # [N, d_k]
        k = torch.randn(keys, d_k, generator=generator, dtype=torch.float64)  # [S, d_k]
        scores = q @ k.T  # [N, S]
        raw = softmax_stats(scores)
        scaled = softmax_stats(scores / math.sqrt(d_k))
        rows.append({"d_k": d_k, "std_qk": spread, "sqrt_d_k": math.sqrt(d_k), "std_scaled": spread / math.sqrt(d_k),
                     **{f"{key}_unscaled": value for key, value in raw.items()},
                     **{f"{key}_scaled": value for key, value in scaled.items()}})
    return rows


def seed_examples() -> list[dict]:
    """The attention chapter's two softmaxes and the size (Frobenius norm) of each one's Jacobian
    ``diag(p) - p p^T``."""
    rows = []
    for scores in ([1.0, 2.0, 3.0], [8.0, 16.0, 24.0]):
        s = torch.tensor(scores, dtype=torch.float64)  # [3]
        p = torch.softmax(s, dim=-1)  # [3]
        jacobian = softmax_jacobian(p[None])[0]  # [3, 3]: d p_i / d s_j
        rows.append({"scores": str(scores), "softmax": "[" + ", ".join(f"{x:.4f}" for x in p.tolist()) + "]",
                     "jacobian_norm": float(jacobian.norm())})
    return rows


def plot(rows: list[dict], keys: int, path) -> None:
    """Spread, saturation and gradient against d_k, without and with the division by sqrt(d_k)."""
    fig, (ax_std, ax_max, ax_grad) = plots.figure(ncols=3, width=5.0, height=4.4)
    dims = [r["d_k"] for r in rows]
    plots.loglog(ax_std, "Spread of q.k", "head dim d_k", "standard deviation of the score")
    plots.series(ax_std, dims, [r["std_qk"] for r in rows], "q.k (measured)", 0)
    plots.series(ax_std, dims, [r["std_scaled"] for r in rows], "q.k / sqrt(d_k) (measured)", 1)
    ax_std.plot(dims, [r["sqrt_d_k"] for r in rows], "--", color="grey", label="sqrt(d_k)")
    ax_std.legend(fontsize=8)

    ax_max.set_xscale("log", base=2)
    ax_max.grid(True, which="both", alpha=0.3)
    ax_max.set_title(f"Saturation: largest softmax weight ({keys} keys)")
    ax_max.set_xlabel("head dim d_k")
    ax_max.set_ylabel("weight / share of rows (0..1)")
    plots.series(ax_max, dims, [r["max_weight_unscaled"] for r in rows], "unscaled: mean top weight", 0, color="C0")
    plots.series(ax_max, dims, [r["saturated_unscaled"] for r in rows], "unscaled: share of rows with top > 0.99", 0,
                 color="C0", linestyle="--", markerfacecolor="white")
    plots.series(ax_max, dims, [r["max_weight_scaled"] for r in rows], "scaled: mean top weight", 1, color="C1")
    ax_max.axhline(1.0 / keys, color="grey", linestyle=":", label=f"uniform (1/{keys})")
    ax_max.set_ylim(0, 1.05)
    ax_max.legend(fontsize=8)

    plots.loglog(ax_grad, "Gradient of the softmax", "head dim d_k", "|d weights / d scores| (Frobenius)")
    plots.series(ax_grad, dims, [r["grad_median_unscaled"] for r in rows], "unscaled: median row", 0, color="C0")
    plots.series(ax_grad, dims, [r["grad_mean_unscaled"] for r in rows], "unscaled: mean", 0, color="C0",
                 linestyle="--", markerfacecolor="white")
    plots.series(ax_grad, dims, [r["grad_median_scaled"] for r in rows], "scaled: median row", 1, color="C1")
    ax_grad.legend(fontsize=8)
    plots.save(fig, path)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.samples, args.max_dim = 200, 1024
    if args.max_dim < 4:
        print(f"error: --max-dim must be at least 4, got {args.max_dim}")
        return 2
    dims = sorted({2 ** i for i in range(2, int(math.log2(args.max_dim)) + 1)} | set(HEADLINE_DIMS))
    rows = sweep(dims, args.samples, args.keys, args.seed)
    headline = [r for r in rows if r["d_k"] in HEADLINE_DIMS]
    print(f"1. spread of q.k over {args.samples} random pairs (attention-from-scratch lesson: 4.10, 11.47, 31.77)\n")
    print(format_table(headline, ["d_k", "std_qk", "sqrt_d_k", "std_scaled"]))
    print("\n2. the attention chapter's saturation example (Jacobian norm: how much the softmax can still move)\n")
    print(format_table(seed_examples(), ["scores", "softmax", "jacobian_norm"]))
    print(f"\n3. softmax over {args.keys} keys, without and with scaling ({args.samples} random query rows)\n")
    print(format_table(headline, ["d_k", "max_weight_unscaled", "saturated_unscaled", "grad_median_unscaled",
                                  "max_weight_scaled", "saturated_scaled", "grad_median_scaled"]))
    big = headline[-1]
    print(f"\nat d_k = {big['d_k']} without scaling {100 * big['saturated_unscaled']:.0f}% of rows put > 99% of "
          f"their weight on one key, and the median row's softmax gradient is "
          f"{big['grad_median_scaled'] / max(big['grad_median_unscaled'], 1e-300):,.0f}x smaller than with scaling: "
          f"training through it stalls.")
    paths = save_results(args.out, "explain_scaling", rows, {"command": "explain scaling", "args": vars(args),
                                                             "seed_examples": seed_examples()})
    plot(rows, args.keys, f"{args.out}/explain_scaling.png")
    print("\nwrote " + ", ".join(str(p) for p in paths) + f", {args.out}/explain_scaling.png")
    return 0
