"""``run.py show weights``: heatmaps of attention weights, so a person can see each mask.

The weight matrix comes from the engine itself: with ``v`` the identity, ``out = weights @ I = weights``, so
``causal_attention(q, k, v=I, kernel="reference")`` returns the ``[T, S]`` weights exactly as the engine's
reference computes them (every fast kernel is tested against it).

- ``six_tokens``: the attention chapter's six-token example ("Your journey starts with one step", q = k = x,
  scale 1), causal and not; the causal table is checked against the chapter's printed digits (the output
  calls the chapter "seed").
- One heatmap per mask family, built from ``engine.masks`` and passed as ``allowed`` (composed with the causal
  rule by ``&``). Scores are 0 by default (q = 0), so every row spreads evenly over the keys it may see and the
  picture *is* the mask: a row with n visible keys shows 1/n in each, a row with none is all 0.
"""

from __future__ import annotations

import argparse

import torch

from engine.attention import causal_attention
from engine.masks import document_mask, padding_mask, window_mask
from engine.seeds import SEED_CAUSAL_TABLE, SIX_TOKENS, WORDS
from lab import plots
from lab.options import parse_counts, positive_int

FAMILIES = ("causal", "window", "documents", "padding", "none")


def attention_weights(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None = None,
                      scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """``[T, S]`` weights of one head: q ``[T, D]``, k ``[S, D]``; ``allowed`` broadcastable to ``[1, 1, T, S]``."""
    identity = torch.eye(k.shape[0], dtype=q.dtype)  # [S, S]: out = weights @ I
    out = causal_attention(q[None, None], k[None, None], identity[None, None], allowed=allowed, scale=scale,
                           causal=causal, kernel="reference")  # [1, 1, T, S]
    return out[0, 0]


def six_token_weights() -> dict[str, torch.Tensor]:
    """The attention chapter's six tokens: x as q and k, one head, scale 1, with and without the causal rule."""
    return {"causal": attention_weights(SIX_TOKENS, SIX_TOKENS, scale=1.0),
            "not causal": attention_weights(SIX_TOKENS, SIX_TOKENS, scale=1.0, causal=False)}


def family_weights(family: str, length: int, window: int, doc_lengths: list[int], valid: int,
                   random_scores: bool = False, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``([T, T] weights, description)`` for one mask family over positions 0..length-1."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(length, 8, generator=generator, dtype=torch.float64) if random_scores else \
        torch.zeros(length, 8, dtype=torch.float64)  # [T, 8]
    k = torch.randn(length, 8, generator=generator, dtype=torch.float64)  # [T, 8]
    positions = torch.arange(length)  # [T]
    if family == "causal":
        return attention_weights(q, k), "causal\nkey_pos <= query_pos"
    if family == "none":
        return attention_weights(q, k, causal=False), "no mask (encoder)\nevery key"
    if family == "window":
        return (attention_weights(q, k, allowed=window_mask(positions, positions, window)),
                f"causal & window {window}\nthe last {window} keys, own included")
    if family == "documents":
        if sum(doc_lengths) != length:
            raise ValueError(f"--doc-lengths must add up to --length ({length}), got {doc_lengths}")
        ids = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))  # [T]
        return (attention_weights(q, k, allowed=document_mask(ids)),
                f"causal & documents {doc_lengths}\nown document only")
    if family == "padding":
        if not 0 <= valid <= length:
            raise ValueError(f"--valid must lie in [0, --length = {length}], got {valid}")
        allowed = padding_mask(torch.tensor([valid]), length)  # [1, 1, T, T]
        return (attention_weights(q, k, allowed=allowed),
                f"causal & padding: {valid} real, {length - valid} pads\npad rows see nothing (output 0)")
    raise ValueError(f"mask family must be one of {', '.join(FAMILIES)}, got {family!r}")


def check_six_tokens(weights: torch.Tensor) -> tuple[list[str], list[str]]:
    """Compare the causal six-token weights with the attention chapter's table at its 3 printed decimals.

    Returns ``(mismatches, double_rounded)``. A weight one unit off in the last digit whose 4-decimal value
    rounds half-up to the chapter's digit is the chapter's double rounding (it prints 0.1385, then 0.139 for
    0.13847), not an error; anything else is a mismatch. The returned notes call the chapter's value "seed".
    """
    mismatches, double_rounded = [], []
    for word, row, stated in zip(WORDS, weights.tolist(), SEED_CAUSAL_TABLE):
        for key, (value, seed_text) in enumerate(zip(row, stated.split())):
            ours = f"{value:.3f}"
            if ours == seed_text:
                continue
            four = round(value, 4)
            twice = int(four * 1000 + 0.5 + 1e-9) / 1000  # round the 4-decimal value half-up to 3 decimals
            note = f"{word} -> {WORDS[key]}: {value:.5f} prints {ours}, seed {seed_text}"
            (double_rounded if f"{twice:.3f}" == seed_text else mismatches).append(note)
    return mismatches, double_rounded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mask", choices=("all",) + FAMILIES, default="all",
                        help="which mask family to draw besides the six-token example (default all)")
    parser.add_argument("--length", type=positive_int, default=12, help="tokens in the mask pictures (default 12)")
    parser.add_argument("--window", type=positive_int, default=4, help="window size w, keys seen (default 4)")
    parser.add_argument("--doc-lengths", type=parse_counts, default=[4, 5, 3],
                        help="comma-separated lengths of the packed documents; they must sum to --length "
                        "(default 4,5,3)")
    parser.add_argument("--valid", type=int, default=9, help="real tokens before the padding (default 9)")
    parser.add_argument("--random-scores", action="store_true",
                        help="random q and k instead of q = 0 (uniform weights over visible keys)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for --random-scores (default 0)")
    parser.add_argument("--out", default="results/show_weights",
                        help="folder for the PNGs (default results/show_weights)")


def _heatmap_png(panels: list[tuple[str, torch.Tensor, list[str]]], path, ncols: int, annotate: bool,
                 vmax: float | None = None, dpi: int = 100, note: str = ""):
    """One heatmap per panel, with a colour bar each (grey = masked, weight exactly 0); returns the PNG's path."""
    rows = (len(panels) + ncols - 1) // ncols
    size = 4.8 if annotate else 4.0
    fig, axes = plots.figure(ncols=ncols, nrows=rows, width=size, height=size)
    for ax, (title, weights, labels) in zip(axes, panels):
        image = plots.heatmap(ax, weights, labels, labels, title, annotate=annotate,
                              xlabel="key (position)", ylabel="query (position)", vmax=vmax)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="attention weight")
    for ax in axes[len(panels):]:
        ax.axis("off")
        ax.text(0.05, 0.5, "grey: masked (weight exactly 0)\ncoloured: visible keys\n\n" + note, fontsize=11,
                va="center")
    return plots.save(fig, path, dpi=dpi)


def main(args: argparse.Namespace) -> int:
    six = six_token_weights()
    print("the attention chapter's six tokens (q = k = x, scale 1), causal weights; rows are queries:\n")
    print("\n".join(f"{word:>8}  " + " ".join(f"{w:.3f}" for w in row)
                    for word, row in zip(WORDS, six["causal"].tolist())))
    mismatches, double_rounded = check_six_tokens(six["causal"])
    if double_rounded:
        print("\nlast digit differs only by the chapter's double rounding: " + "; ".join(double_rounded))
    print("\nMISMATCH with seed 000: " + "; ".join(mismatches) if mismatches else "matches seed 000's table")
    written: list = [_heatmap_png([(f"Six tokens, {name}", w, WORDS) for name, w in six.items()],
                            f"{args.out}/weights_six_tokens.png", ncols=2, annotate=True)]
    families = FAMILIES if args.mask == "all" else (args.mask,)
    labels = [str(p) for p in range(args.length)]
    panels = []
    try:
        for family in families:
            weights, text = family_weights(family, args.length, args.window, args.doc_lengths, args.valid,
                                           args.random_scores, args.seed)
            panels.append((text, weights, labels))
    except ValueError as error:
        print(f"error: {error}")
        return 2
    annotate = args.length <= 12
    for family, panel in zip(families, panels):
        _heatmap_png([panel], f"{args.out}/weights_{family}.png", ncols=1, annotate=annotate, vmax=1.0)
        written.append(f"{args.out}/weights_{family}.png")
    if len(panels) > 1:
        note = "random q and k" if args.random_scores else \
            "q = 0, so each row spreads\nevenly over the keys it sees:\nn visible keys -> 1/n each"
        _heatmap_png(panels, f"{args.out}/weights_masks.png", ncols=3, annotate=annotate, vmax=1.0, dpi=80, note=note)
        written.append(f"{args.out}/weights_masks.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 1 if mismatches else 0
