"""``run.py attention --impl NAME``: the seeds' worked examples, each result beside the value the seed states.

The seeds are the three source texts the examples come from: the attention chapter (the six-token example
"Your journey starts with one step"), the attention-from-first-principles notes (three tokens by hand) and
the attention-from-scratch lesson (its standard-library program).

Every number is formatted at the precision the seed prints it and compared digit for digit; the command
exits 1 if any differs. ``--impl`` picks who computes the attention: ``engine`` (causal_attention, kernel
chosen automatically), ``lists`` (the standard-library program of the attention-from-scratch lesson),
``loops`` (the per-query loop), or any kernel of ``engine.kernels.dispatch.KERNELS`` by name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import causal_attention
from engine.kernels.dispatch import KERNELS
from engine.reference import lists
from engine.reference.loops import per_query_attention
from engine.seeds import SEED_CAUSAL_TABLE, SIX_TOKENS, WORDS
from engine.softmax import naive_softmax, stable_softmax

# An implementation: (q [T, D], k [S, D], v [S, Dv], causal, scale, valid keys) -> out [T, Dv] (float64)
Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, "float | None", "int | None"], torch.Tensor]

def _engine_impl(kernel: str) -> Impl:
    def run(q, k, v, causal, scale, valid):
        allowed = None
        if valid is not None:
            allowed = torch.arange(k.shape[0]) < valid  # [S] -> broadcasts to [B, Hq, T, S]
        out = causal_attention(q[None, None], k[None, None], v[None, None], allowed=allowed, scale=scale,
                               causal=causal, kernel=kernel)  # [1, 1, T, Dv]
        return out[0, 0].double()
    return run


def _lists_impl(q, k, v, causal, scale, valid):
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError("the lists implementation aligns causal queries with keys 0..T-1 (T == S)")
    out, _ = lists.attention(q.tolist(), k.tolist(), v.tolist(), causal=causal, valid=valid, scale=scale)
    return torch.tensor(out, dtype=torch.float64)


def _loops_impl(q, k, v, causal, scale, valid):
    allowed = None if valid is None else torch.arange(k.shape[0]) < valid
    return per_query_attention(q[None, None], k[None, None], v[None, None], allowed=allowed, scale=scale,
                               causal=causal)[0, 0]


def implementations() -> dict[str, Impl]:
    impls: dict[str, Impl] = {"engine": _engine_impl("auto"), "lists": _lists_impl, "loops": _loops_impl}
    impls.update({name: _engine_impl(name) for name in KERNELS})
    return impls


def weights_of(impl: Impl, q, k, causal, scale=None, valid=None) -> torch.Tensor:
    """Attention weights ``[T, S]`` from any implementation: attend over one-hot values ``v = I_S``."""
    return impl(q, k, torch.eye(k.shape[0], dtype=q.dtype), causal, scale, valid)


def fmt(values, digits: int) -> str:
    return " ".join(f"{float(x):.{digits}f}" for x in values)


def _last_digit_units(computed: str, stated: str) -> float | None:
    """Largest difference between two equally formatted number lists, in units of the last stated digit."""
    a, b = computed.split(), stated.split()
    try:
        digits = [len(x.split(".")[1]) if "." in x else 0 for x in b]
        return max(abs(float(x) - float(y)) * 10**d for x, y, d in zip(a, b, digits)) if len(a) == len(b) else None
    except ValueError:
        return None


@dataclass
class Report:
    """Each check compares digit for digit. A value whose last digit is off by exactly one is reported as
    ``ok~``: the seed rounded an already rounded number (it writes 0.1385 then 0.139) or summed rounded
    terms (0.248 + 0.248 + 0.504 = 1); the note says which digits differ."""

    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)
    near: int = 0

    def check(self, name: str, computed: str, stated: str) -> None:
        units = _last_digit_units(computed, stated)
        exact = computed == stated
        ok = exact or (units is not None and units <= 1.0 + 1e-9)
        self.near += ok and not exact
        self.rows.append((name, computed, stated, ok))
        mark = "ok  " if exact else "ok~ " if ok else "FAIL"
        note = "" if exact or not ok else "   (last digit off by one: the seed rounded intermediate values)"
        print(f"  [{mark}] {name}\n         computed: {computed}\n         seed:     {stated}{note}")

    @property
    def failures(self) -> int:
        return sum(not ok for *_, ok in self.rows)


def section(title: str) -> None:
    print(f"\n== {title}")


def run_examples(impl: Impl, use_lists_softmax: bool = False) -> Report:
    rep = Report()
    x = SIX_TOKENS

    section("Attention chapter, Step 1: attention for 'journey' with no parameters (scale 1, no mask)")
    rep.check("scores = x @ x[1]", fmt(x @ x[1], 4), "0.9544 1.4950 1.4754 0.8434 0.7070 1.0865")
    w = weights_of(impl, x[1:2], x, causal=False, scale=1.0)[0]
    rep.check("weights = softmax(scores)", fmt(w, 4), "0.1385 0.2379 0.2333 0.1240 0.1082 0.1581")
    z = impl(x[1:2], x, x, False, 1.0, None)[0]
    rep.check("context vector z_journey", fmt(z, 4), "0.4419 0.6515 0.5683")

    section("Attention chapter, Step 4: causal weights of the six tokens (scale 1)")
    table = weights_of(impl, x, x, causal=True, scale=1.0)
    for i, word in enumerate(WORDS):
        rep.check(f"row {i} ({word})", fmt(table[i], 3), SEED_CAUSAL_TABLE[i])

    section("Attention-from-first-principles notes, section 4: three tokens by hand "
            "(d_head = 2, scale 1/sqrt(2), causal)")
    q3 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    v3 = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]], dtype=torch.float64)
    scaled = (q3 @ q3.T) / math.sqrt(2)
    rep.check("scaled scores, row 2", fmt(scaled[2], 3), "0.707 0.707 1.414")
    w3 = weights_of(impl, q3, q3, causal=True)
    rep.check("weights, row 1", fmt(w3[1, :2], 3), "0.330 0.670")
    rep.check("weights, row 2", fmt(w3[2], 3), "0.248 0.248 0.504")
    out3 = impl(q3, q3, v3, True, None, None)
    for i, stated in enumerate(["10.00 0.00", "3.30 6.70", "5.00 5.00"]):
        rep.check(f"out[{i}]", fmt(out3[i], 2), stated)

    section("Attention chapter, Step 3: softmax saturates on large scores")
    softmax = (lambda s: torch.tensor(lists.softmax(s.tolist()))) if use_lists_softmax else stable_softmax
    rep.check("softmax([1, 2, 3])", fmt(softmax(torch.tensor([1.0, 2.0, 3.0])), 2), "0.09 0.24 0.67")
    rep.check("softmax([8, 16, 24])", fmt(softmax(torch.tensor([8.0, 16.0, 24.0])), 4), "0.0000 0.0003 0.9997")

    section("Attention-from-scratch lesson: naive vs stable softmax on [1000, 999, 0]")
    big = torch.tensor([1000.0, 999.0, 0.0])
    naive = naive_softmax(big)
    rep.check("naive softmax overflows", "overflow" if not bool(torch.isfinite(naive).all()) else fmt(naive, 4),
              "overflow")
    rep.check("stable softmax", fmt(softmax(big), 4), "0.7311 0.2689 0.0000")

    section("Attention-from-scratch lesson: causality (edit only the last of 5 tokens; d = 8, random.Random(3))")
    X, Wq, Wk, Wv = lists.seed_program_inputs()
    proj = lambda X: [torch.tensor(lists.project(X, W), dtype=torch.float64) for W in (Wq, Wk, Wv)]
    out_a = impl(*proj(X), True, None, None)
    out_b = impl(*proj(lists.edit_last_token(X)), True, None, None)
    diff = (out_a - out_b).abs().amax(dim=-1)
    rep.check("max change per position", fmt(diff, 3), "0.000 0.000 0.000 0.000 5.277")
    rep.check("positions 0-3 bit-identical", str(bool(torch.equal(out_a[:4], out_b[:4]))), "True")

    section("Attention-from-scratch lesson: padding (3 real tokens of 5, no causal mask), weights of query 0")
    Q, K, _ = proj(X)
    wp = weights_of(impl, Q, K, causal=False, valid=3)
    rep.check("query 0", fmt(wp[0], 2), "0.40 0.13 0.47 0.00 0.00")

    section("Attention-from-scratch lesson: why divide by sqrt(d_k) (sd of q.k for random unit-variance vectors)")
    for dk, sd_stated, after in ((16, "4.10", "1.03"), (128, "11.47", "1.01"), (1024, "31.77", "0.99")):
        sd = lists.dot_spread(dk)
        rep.check(f"d_k={dk}: sd, sd/sqrt(d_k)", f"{sd:.2f} {sd / math.sqrt(dk):.2f}", f"{sd_stated} {after}")
    return rep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--impl", default="engine", choices=sorted(implementations()),
                        help="who computes attention: engine (auto kernel), lists, loops, or a kernel name")


def main(args: argparse.Namespace) -> int:
    print(f"Worked examples of the seeds, computed with --impl {args.impl}")
    rep = run_examples(implementations()[args.impl], use_lists_softmax=args.impl == "lists")
    total = len(rep.rows)
    print(f"\n{total - rep.failures}/{total} results match the seeds' stated values "
          f"({rep.near} within one unit of the seed's last digit)", end="")
    if rep.failures:
        print(f"; {rep.failures} differ:")
        for name, computed, stated, ok in rep.rows:
            if not ok:
                print(f"  {name}: computed {computed}, seed {stated}")
        return 1
    print(".")
    return 0
