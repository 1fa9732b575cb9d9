"""Attention on Python lists, standard library only (the program of the attention-from-scratch lesson).

softmax(Q K^T / sqrt(d) + mask) V with causal and padding masks. ``seed_program_lines()`` runs the
program the way the lesson does (``random.Random(3)``) and returns its printed lines.
"""

from __future__ import annotations

import math
import random

NEG_INF = float("-inf")

Matrix = list[list[float]]


def softmax(row: list[float]) -> list[float]:
    """Stable softmax of one row; a fully masked row (all -inf) gives zeros, not NaN."""
    m = max(row)
    if m == NEG_INF:
        return [0.0] * len(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def naive_softmax(row: list[float]) -> list[float]:
    """``exp(x) / sum(exp(x))``: raises OverflowError for scores near 710 and above."""
    total = sum(math.exp(y) for y in row)
    return [math.exp(x) / total for x in row]


def attention(Q: Matrix, K: Matrix, V: Matrix, causal: bool, valid: int | None = None,
              scale: float | None = None) -> tuple[Matrix, Matrix]:
    """Return ``(outputs [n_q][d_v], weights [n_q][n_k])``.

    Query i sees key j unless ``causal and j > i`` or ``j >= valid`` (padding after ``valid`` keys).
    ``scale`` defaults to ``1/sqrt(d)``.
    """
    d = len(Q[0])
    n = len(K)
    valid = n if valid is None else valid
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out, weights = [], []
    for i, q in enumerate(Q):
        row = []
        for j, k in enumerate(K):
            if (causal and j > i) or j >= valid:
                row.append(NEG_INF)
            else:
                row.append(sum(a * b for a, b in zip(q, k)) * scale)
        w = softmax(row)
        weights.append(w)
        out.append([sum(w[j] * V[j][c] for j in range(n)) for c in range(len(V[0]))])
    return out, weights


def rand(rows: int, cols: int, rng: random.Random) -> Matrix:
    return [[rng.gauss(0, 1) for _ in range(cols)] for _ in range(rows)]


def project(X: Matrix, W: Matrix) -> Matrix:
    """``X @ W / sqrt(d)``, as the lesson's ``proj``."""
    d = len(W)
    return [[sum(x[k] * W[k][c] for k in range(d)) / math.sqrt(d) for c in range(len(W[0]))] for x in X]


def seed_program_inputs() -> tuple[Matrix, Matrix, Matrix, Matrix]:
    """The lesson program's random draws: ``(X [5][8], Wq, Wk, Wv [8][8])`` from ``random.Random(3)``."""
    rng = random.Random(3)
    n, d = 5, 8
    X = rand(n, d, rng)
    Wq, Wk, Wv = (rand(d, d, rng) for _ in range(3))
    return X, Wq, Wk, Wv


def edit_last_token(X: Matrix) -> Matrix:
    """The lesson's causality probe: a copy of X whose last token has 5.0 added to every feature."""
    X2 = [r[:] for r in X]
    X2[-1] = [x + 5.0 for x in X2[-1]]
    return X2


def dot_spread(dk: int, samples: int = 2000) -> float:
    """Root-mean-square of ``q.k`` for random unit-variance vectors of width dk (the lesson's
    ``random.Random(dk)``)."""
    r = random.Random(dk)
    dots = [sum(r.gauss(0, 1) * r.gauss(0, 1) for _ in range(dk)) for _ in range(samples)]
    return math.sqrt(sum(x * x for x in dots) / len(dots))


def seed_program_lines() -> list[str]:
    """Run the lesson's program (five positions, d = 8, ``random.Random(3)``) and return what it prints."""
    lines: list[str] = []
    X, Wq, Wk, Wv = seed_program_inputs()
    Q, K, V = project(X, Wq), project(X, Wk), project(X, Wv)

    out, w = attention(Q, K, V, causal=True)
    lines.append("causal attention weights (row = query position)")
    for row in w:
        lines.append("  " + " ".join(f"{x:5.2f}" for x in row) + f"   sum={sum(row):.3f}")

    X2 = edit_last_token(X)  # change only the last token
    out2, _ = attention(project(X2, Wq), project(X2, Wk), project(X2, Wv), causal=True)
    diff = [max(abs(a - b) for a, b in zip(r1, r2)) for r1, r2 in zip(out, out2)]
    lines.append("max change per position after editing token 4: " + " ".join(f"{x:.3f}" for x in diff))

    _, wp = attention(Q, K, V, causal=False, valid=3)
    lines.append("padding mask, 3 real tokens of 5, query 0: " + " ".join(f"{x:.2f}" for x in wp[0]))

    big = [1000.0, 999.0, 0.0]
    try:
        naive: object = naive_softmax(big)
    except OverflowError as e:
        naive = f"OverflowError: {e}"
    lines.append(f"naive softmax of [1000, 999, 0]: {naive}")
    lines.append(f"stable softmax:                  {[round(x, 4) for x in softmax(big)]}")

    for dk in (16, 128, 1024):
        sd = dot_spread(dk)
        lines.append(f"d_k={dk:<5} sd of q.k = {sd:6.2f}  (sqrt(d_k) = {math.sqrt(dk):5.2f}); "
                     f"after scaling = {sd / math.sqrt(dk):.2f}")
    return lines
