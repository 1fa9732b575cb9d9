"""Power laws fitted on log-log axes: ``y = coefficient * x ** exponent``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares line through ``(log x, log y)``; returns ``(exponent, coefficient)``.

    Needs at least two points with positive x and y (others are dropped). Example: ``ys = 3 * xs ** 2`` gives
    ``(2.0, 3.0)``.
    """
    pairs = [(x, y) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0 and math.isfinite(y)]
    if len({x for x, _ in pairs}) < 2:
        raise ValueError(f"a power-law fit needs two or more distinct positive points, got {len(pairs)}")
    log_x = np.log([x for x, _ in pairs])
    log_y = np.log([y for _, y in pairs])
    exponent, intercept = np.polyfit(log_x, log_y, 1)
    return float(exponent), float(math.exp(intercept))


def solve_power_law(exponent: float, coefficient: float, y: float) -> float:
    """The x where ``coefficient * x ** exponent`` reaches ``y`` (inf when the law does not grow)."""
    if exponent <= 0 or coefficient <= 0:
        return math.inf
    return (y / coefficient) ** (1.0 / exponent)
