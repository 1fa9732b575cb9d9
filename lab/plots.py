"""Plotting for the lab: matplotlib with the Agg backend (no display), small readable PNGs.

Every plot has a title, axis labels with units and a legend; log axes where the seeds reason in powers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib import ticker  # noqa: E402

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def figure(ncols: int = 1, nrows: int = 1, width: float = 5.6, height: float = 4.2):
    """``(fig, axes)`` with ``axes`` always a flat list, sized ``width x height`` inches per panel."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, list(axes.ravel())


def save(fig, path: str | Path, dpi: int = 100) -> Path:
    """Lay out, write the PNG and close the figure (PNGs stay well under 200 KB at this dpi)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for ax in fig.axes:
        for axis, scale, limits in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                    (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
            if scale == "log" and getattr(axis.get_major_locator(), "_base", 10) == 10:
                plain_log_labels(axis, limits)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plain_log_labels(axis, limits: tuple[float, float]) -> None:
    """Label a base-10 log axis with plain numbers (0.5, 20, 1000) instead of 5x10^-1; on a short axis
    (under two decades) label the 2 and 5 minor ticks too, so a reader always has a number nearby."""
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(plain)
    low, high = (max(min(limits), 1e-300), max(limits))
    if np.log10(high / low) < 2:
        axis.set_minor_formatter(ticker.FuncFormatter(
            lambda value, _: f"{value:g}" if round(value / 10 ** np.floor(np.log10(value) + 1e-9)) in (2, 5) else ""))
    else:
        axis.set_minor_formatter(ticker.NullFormatter())


def loglog(ax, title: str, xlabel: str, ylabel: str, base: int = 2) -> None:
    """Log axes (x in powers of ``base``, y in powers of 10), a grid, a title and labels."""
    ax.set_xscale("log", base=base)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def series(ax, xs: Sequence[float], ys: Sequence[float], label: str, index: int = 0, **style) -> None:
    """One measured line with markers; points that are missing (None or NaN) are left out."""
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and y == y and y > 0]
    if not pairs:
        return
    x, y = zip(*pairs)
    ax.plot(x, y, marker=MARKERS[index % len(MARKERS)], label=label, **style)


def grouped_bars(ax, cases: Sequence[str], bars: dict[str, Sequence[float]], target: float | None = None) -> None:
    """One group of bars per case (the x labels, slanted), one bar per entry of ``bars`` (label -> a value per
    case), and a dashed grey line at ``target``."""
    width = 0.8 / max(1, len(bars))
    for offset, (label, values) in enumerate(bars.items()):
        ax.bar([i + width * offset for i in range(len(cases))], values, width=width, label=label)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", label=f"target {target}x")
    ax.set_xticks([i + width * (len(bars) - 1) / 2 for i in range(len(cases))], cases, rotation=30, ha="right",
                  fontsize=7)
    lowest = min((v for values in bars.values() for v in values), default=1.0)
    ax.set_ylim(bottom=min(0.9, 0.95 * lowest))  # (ratios near 1: the axis starts below the lowest bar, not at 0)
    ax.legend(fontsize=8)


def power_guide(ax, xs: Sequence[float], anchor: tuple[float, float], exponent: float, label: str,
                linestyle: str = "--") -> None:
    """A grey reference line ``y = anchor_y * (x / anchor_x) ** exponent`` (e.g. slope 2 for T^2)."""
    x = np.array([min(xs), max(xs)], dtype=float)
    ax.plot(x, anchor[1] * (x / anchor[0]) ** exponent, linestyle, color="grey", alpha=0.8, label=label)


def heatmap(ax, matrix, row_labels: Sequence[str], col_labels: Sequence[str], title: str,
            annotate: bool = True, xlabel: str = "key", ylabel: str = "query", vmax: float | None = None):
    """Weights as an image; cells that are exactly 0 (masked keys) are grey, visible ones coloured by weight
    from 0 to ``vmax`` (default the largest weight), with the value printed in each cell when ``annotate``."""
    values = np.asarray(matrix, dtype=float)
    top = vmax if vmax is not None else max(1e-9, float(values.max()))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")
    image = ax.imshow(np.ma.masked_equal(values, 0.0), cmap=cmap, vmin=0.0, vmax=top)
    small = len(col_labels) > 8
    ax.set_xticks(range(len(col_labels)), labels=col_labels, rotation=60 if small else 0, fontsize=8 if small else 9)
    ax.set_yticks(range(len(row_labels)), labels=row_labels, fontsize=8 if small else 9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if annotate:
        for i in range(values.shape[0]):
            for j in range(values.shape[1]):
                value = values[i, j]
                text = "1" if value == 1 else f"{value:.3f}".lstrip("0") if value else ""
                ax.text(j, i, text, ha="center", va="center", fontsize=7,
                        color="black" if value > 0.6 * top else "white")
    return image
