"""The score-modifier cases of ``run.py bench kernels`` (group ``modifiers``): sinks, ALiBi and a relative-position
bias on causal prefill, against the peers computing the same thing:

- PyTorch SDPA with the dense additive float mask ``[1, Hq, T, S]`` (the bias where visible, -inf elsewhere);
  sinks as one extra key of zeros whose mask column holds the sink (``exp(sink)`` joins the denominator, its
  value adds nothing). Skipped where the mask alone would not fit in memory (it is ``4 * Hq * T * S`` bytes);
- FlexAttention compiled for CPU with the same modifier as its ``score_mod`` (index arithmetic on ``q_idx`` /
  ``kv_idx``, the bucket table read by index) and the causal block mask;
- the engine: ``kernel="auto"`` (the kernel it picks is in the label), the tiled kernel forced, and for the bias
  the same dense tensor SDPA gets (``engine dense bias``) beside the structured ``RelativePositionBias``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import causal_attention
from engine.planning import explain
from engine.relative_bias import RelativePositionBias
from lab.bench.kernel_cases import Case, Impl, _qkv, causal_pairs

DENSE_MASK_LIMIT = 6 << 30  # bytes: a dense fp32 mask above this is not built (SDPA would also need its copies)


def _engine(q, k, v, label_kernels: tuple[str, ...], **kwargs) -> list[Impl]:
    auto = explain(q, k, v, **kwargs).kernel
    impls = [Impl(f"engine ({auto})", lambda: causal_attention(q, k, v, **kwargs))]
    return impls + [Impl(f"engine:{name}", lambda name=name: causal_attention(q, k, v, kernel=name, **kwargs))
                    for name in label_kernels]


def _flex(q, k, v, score_mod, mask_mod) -> Impl:
    """FlexAttention compiled for CPU with ``score_mod`` and the block mask of ``mask_mod`` (setup timed apart)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    state: dict[str, Any] = {}

    def setup() -> None:
        torch._dynamo.reset()  # nine cases would pass dynamo's recompile limit: the last would run unfused (O(T^2))
        state["mask"] = create_block_mask(mask_mod, None, None, q.shape[2], k.shape[2], device="cpu")
        state["fn"] = torch.compile(flex_attention, dynamic=False)
        run()

    def run():
        return state["fn"](q, k, v, score_mod=score_mod, block_mask=state["mask"])

    return Impl("flex (compiled)", run, "peer", setup)


def _sdpa_dense(q, k, v, bias: Callable[[], torch.Tensor], note: str = "") -> Impl:
    """SDPA with a dense additive float mask built once (outside the timing)."""
    t, s = q.shape[2], k.shape[2]
    mask_bytes = 4 * q.shape[1] * t * s
    if mask_bytes > DENSE_MASK_LIMIT:
        return Impl("sdpa dense bias", lambda: None, "peer",
                    note=f"failed: not run: its dense mask would take {mask_bytes / 2 ** 30:.0f} GiB")
    state: dict[str, torch.Tensor] = {}

    def setup() -> None:
        state["mask"] = bias()  # [1, Hq, T, S]

    return Impl("sdpa dense bias", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=state["mask"]), "peer",
                setup, note)


def _causal(t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] <= torch.arange(t)[:, None]  # [T, T]


def sinks_case(t: int, heads: int, d: int, flex: bool) -> Case:
    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d)
        sinks = torch.linspace(-1.0, 2.0, heads)
        impls = _engine(q, k, v, ("tiled",), sinks=sinks)
        k1, v1 = (torch.cat([x, x.new_zeros(1, heads, 1, d)], dim=2) for x in (k, v))  # one more key: zeros

        def dense() -> torch.Tensor:
            mask = torch.zeros(1, heads, t, t + 1)  # [1, Hq, T, T+1]
            mask[..., :t].masked_fill_(~_causal(t), float("-inf"))
            mask[..., t] = sinks[:, None]  # the extra key scores 0 + sink
            return mask
        impls.append(_sdpa_dense(q, k1, v1, dense, "sinks as an extra zero key"))
        if flex:
            impls.append(_flex(q, k1, v1, lambda s, b, h, i, j: torch.where(j == t, sinks[h], s),
                               lambda b, h, i, j: (j <= i) | (j == t)))
        return impls
    return Case("modifiers", f"sinks, causal T={t}", {"T": t, "S": t}, build, 4 * d * heads * causal_pairs(t))


def alibi_case(t: int, heads: int, d: int, flex: bool) -> Case:
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])  # the ALiBi paper's geometric slopes

    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d)
        impls = _engine(q, k, v, ("tiled",), alibi_slopes=slopes)
        pos = torch.arange(t)

        def dense() -> torch.Tensor:
            distance = (pos[None, :] - pos[:, None]).float()  # [T, T]: key - query
            return (slopes[:, None, None] * distance).masked_fill_(~_causal(t), float("-inf"))[None]  # [1, Hq, T, T]
        impls.append(_sdpa_dense(q, k, v, dense))
        if flex:
            impls.append(_flex(q, k, v, lambda s, b, h, i, j: s + slopes[h] * (j - i), lambda b, h, i, j: j <= i))
        return impls
    return Case("modifiers", f"ALiBi, causal T={t}", {"T": t, "S": t}, build, 4 * d * heads * causal_pairs(t))


def relative_bias_case(t: int, heads: int, d: int, flex: bool) -> Case:
    """T5's bucketed relative bias (32 buckets, max distance 128, decoder side) on causal prefill."""
    table = torch.randn(heads, 32, generator=torch.Generator().manual_seed(0))
    bias = RelativePositionBias(table, bidirectional=False, max_distance=128)

    def build() -> list[Impl]:
        q, k, v = _qkv(1, heads, heads, t, t, d)
        impls = _engine(q, k, v, ("tiled",), bias=bias)
        pos = torch.arange(t)

        def dense() -> torch.Tensor:
            return bias.block(pos[None], pos[None]).masked_fill_(~_causal(t), float("-inf"))  # [1, Hq, T, T]
        sdpa = _sdpa_dense(q, k, v, dense)
        impls.append(sdpa)
        if not sdpa.note.startswith("failed"):  # the engine on the same dense tensor
            held: dict[str, torch.Tensor] = {}
            impls.append(Impl("engine dense bias", lambda: causal_attention(q, k, v, bias=held["bias"]),
                              setup=lambda: held.update(bias=bias.block(pos[None], pos[None]))))
        if flex:
            buckets = bias.buckets(torch.arange(-(t - 1), t))  # [2T - 1]: the bucket of each key - query
            impls.append(_flex(q, k, v, lambda s, b, h, i, j: s + table[h, buckets[j - i + t - 1]],
                               lambda b, h, i, j: j <= i))
        return impls
    return Case("modifiers", f"relative bias, causal T={t}", {"T": t, "S": t}, build,
                4 * d * heads * causal_pairs(t))


def modifier_cases(quick: bool, heads: int, d: int, flex: bool) -> list[Case]:
    lengths = (512, 1024) if quick else (4096, 8192, 16384)
    return [make(t, heads, d, flex) for make in (sinks_case, alibi_case, relative_bias_case) for t in lengths]


def plot_modifiers(rows: list[dict[str, Any]], out) -> list:
    """``kernels_modifiers.png``: median ms per call vs T for each modifier, every implementation (empty: no file)."""
    from lab import plots

    measured = [r for r in rows if r["group"] == "modifiers" and "ms" in r]
    if not measured:
        return []
    kinds = list(dict.fromkeys(r["case"].split(",")[0] for r in measured))  # sinks, ALiBi, relative bias
    fig, axes = plots.figure(ncols=len(kinds))
    for ax, kind in zip(axes, kinds):
        mine = [r for r in measured if r["case"].split(",")[0] == kind]
        labels = sorted({r["impl"].split(" (")[0] if r["impl"].startswith("engine (") else r["impl"] for r in mine},
                        key=lambda s: (not s.startswith("engine"), s))
        for index, label in enumerate(labels):
            points = sorted((r["T"], r["ms"]) for r in mine
                            if r["impl"] == label or (label == "engine" and r["impl"].startswith("engine (")))
            plots.series(ax, [t for t, _ in points], [ms for _, ms in points], label, index)
        plots.loglog(ax, f"{kind}, causal prefill (fp32, Hq=16, D=64)", "sequence length T", "median ms per call")
        ax.legend(fontsize=7)
    return [plots.save(fig, out / "kernels_modifiers.png")]
