"""``run.py bench cp --model``: a scale model of context parallelism: per-rank time, memory and bytes as functions of
T, P, the window, the link bandwidth and the FLOP rate; checked against measured P = 1-4 points, projected to
P = 8-1,024 on stated hardware.

One forward of one layer, per rank, for shards of ``L = T / P`` tokens (causal: zigzag, so every rank does the same
work; window W: contiguous shards, and the figures are a rank's that is not the last: the last one's shard is read
by no other rank)::

    pairs        causal: T^2 / (2P)            window: T W / P (W << T)      visible (query, key) pairs per rank
    FLOPs        4 B Hq D pairs                 (q k^T and p v, 2 FLOPs per multiply-add)
    shard        2 B Hkv L D e + 8 B L          K and V of L tokens in e-byte elements, with their int64 positions
    sent         ring: (P - 1) shard            every shard goes round
                 allgather: (P - 1) shard       every shard to every rank at once
                 direct: n shard                n = the shards a rank's window reaches: ceil((W - 1) / L), at most
                                                P - 1 (causal: every one, P - 1)
    time         ring: P - 1 steps of max(compute_step, shard / bandwidth), then the last shard's compute: compute
                       hides the transfer while a step's compute is the longer; a step whose shard no query sees
                       costs the transfer alone
                 allgather: (P - 1) shard / bandwidth + compute (no overlap)
                 direct: max(own compute, n shard / bandwidth) + the rest of the compute
                 (every transfer also costs the link's latency per message)
    memory       q, k, v, out of the shard, plus   ring: 1 shard in flight   allgather: all P shards   direct: n shards

A measured run of ``run.py bench cp`` (its JSON) calibrates the one free figure, the FLOP rate per process, and
the model is checked against every measured (method, P) point: its bytes are exact by construction (the same
formula), its forward time is reported beside the measured one (on this 2-core machine P > 2 processes share the
cores, which the model states as ``cores``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Layer", "Hardware", "HARDWARE", "predict", "calibrated_flops", "check_rows", "projection_rows",
           "long_context_layers"]


@dataclass(frozen=True)
class Layer:
    """One attention layer's shapes: sequence T, batch B, heads, head dim, element bytes, window (None: causal)."""

    length: int
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    element_bytes: int = 2
    window: int | None = None


@dataclass(frozen=True)
class Hardware:
    """Per process: the FLOP rate its attention runs at, its link's bandwidth (bytes/s each way), and how many
    processes share one core's worth of compute (``cores``: None for one device per process)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    cores: int | None = None
    latency_s: float = 0.0  # per message


# Stated hardware for the projections (bf16, forward attention at about 40 % of an H100-class GPU's dense peak):
HARDWARE = [
    Hardware("8 GPUs, one node (NVLink, 450 GB/s)", 400e12, 450e9, latency_s=10e-6),
    Hardware("64+ nodes (400 Gb/s NIC per GPU, 50 GB/s)", 400e12, 50e9, latency_s=20e-6),
]


def _pairs(layer: Layer, procs: int) -> float:
    t = layer.length
    if layer.window is None:
        return t * t / 2 / procs
    return t * min(layer.window, t) / procs


def _neighbours(layer: Layer, procs: int) -> int:
    """Other ranks' shards one rank's queries reach: all of them for causal attention, a window's few."""
    if procs == 1:
        return 0
    if layer.window is None:
        return procs - 1
    return min(procs - 1, math.ceil((layer.window - 1) / (layer.length / procs)))


def predict(layer: Layer, procs: int, method: str, hardware: Hardware) -> dict[str, float]:
    """Per-rank forward figures: ``flops``, ``sent bytes``, ``compute s``, ``transfer s`` (one shard: the link's
    latency plus its bytes over the bandwidth), ``time s``, ``hidden`` (1.0 when the transfers add at most 5 % to
    the compute), ``memory bytes``."""
    b, e, shard_len = layer.batch, layer.element_bytes, layer.length / procs
    shard = 2 * b * layer.kv_heads * shard_len * layer.head_dim * e + 8 * b * shard_len
    flops = 4 * b * layer.heads * layer.head_dim * _pairs(layer, procs)
    rate = hardware.flops_per_s * (1.0 if hardware.cores is None else min(1.0, hardware.cores / procs))
    compute = flops / rate
    transfer = hardware.latency_s + shard / hardware.bytes_per_s
    seen = _neighbours(layer, procs)  # other shards with visible keys
    own = b * shard_len * (2 * layer.heads + 2 * layer.kv_heads) * layer.head_dim * e  # q, out, k, v of the shard
    if procs == 1:
        sent, time, buffers = 0.0, compute, 0.0
    elif method == "ring":  # step s holds rank r - s's shard (visible for s <= seen); steps 0 .. P-2 also move one
        step = compute / (seen + 1)  # the compute of one visible shard
        sent = (procs - 1) * shard
        time = sum(max(step if s <= seen else 0.0, transfer) for s in range(procs - 1)) + (
            step if seen == procs - 1 else 0.0)
        buffers = shard
    elif method == "allgather":
        sent, time, buffers = (procs - 1) * shard, (procs - 1) * transfer + compute, (procs - 1) * shard
    elif method == "direct":
        step = compute / (seen + 1)
        sent, buffers = seen * shard, seen * shard
        time = max(step, seen * transfer) + seen * step
    else:
        raise ValueError(f"method must be ring, allgather or direct, got {method!r}")
    hidden = 1.0 if time <= 1.05 * compute else 0.0  # the transfers cost at most 5 % beyond the compute
    return {"flops": flops, "sent bytes": sent, "compute s": compute, "transfer s": transfer, "time s": time,
            "hidden": hidden, "memory bytes": own + buffers}


def calibrated_flops(single_fwd_ms: float, layer: Layer) -> float:
    """The FLOP rate one process ran at: a measured single-process forward's FLOPs over its time."""
    return 4 * layer.batch * layer.heads * layer.head_dim * _pairs(layer, 1) / (single_fwd_ms / 1e3)


def check_rows(summary: list[dict[str, Any]], settings: dict[str, Any], bytes_per_s: float,
               cores: int) -> list[dict[str, Any]]:
    """The model beside a measured ``run.py bench cp`` summary (fp32): per (mask, method, P) the measured and the
    modelled forward time and bytes. The FLOP rate comes from each mask's single-process row."""
    rows = []
    for mask in sorted({r["mask"] for r in summary}):
        layer = Layer(settings["length"], settings["batch"], settings["heads"], settings["kv_heads"],
                      settings["head_dim"], 4, settings["window"] if mask == "window" else None)
        single = next(r for r in summary if r["mask"] == mask and r["method"] == "single")
        hardware = Hardware("this machine", calibrated_flops(single["fwd ms"], layer), bytes_per_s, cores)
        for r in summary:
            if r["mask"] != mask or r["method"] == "single":
                continue
            model = predict(layer, r["P"], r["method"], hardware)
            rows.append({"mask": mask, "method": r["method"], "P": r["P"], "measured fwd ms": r["fwd ms"],
                         "model fwd ms": model["time s"] * 1e3, "model / measured": model["time s"] * 1e3 /
                         r["fwd ms"], "model sent MiB": model["sent bytes"] / 2**20,
                         "model MiB (shards)": model["memory bytes"] / 2**20})
    return rows


def projection_rows(layers: list[Layer], procs: list[int], methods: tuple[str, ...] = ("ring", "allgather",
                                                                                        "direct")):
    """Each stated hardware, layer, P and method: the modelled forward per rank."""
    rows = []
    for hardware in HARDWARE:
        for layer in layers:
            for p in procs:
                if layer.length % p:
                    continue
                for method in methods:
                    if method == "direct" and layer.window is None:
                        continue  # the same as allgather for causal attention (every shard is seen)
                    m = predict(layer, p, method, hardware)
                    rows.append({"hardware": hardware.name, "T": layer.length,
                                 "mask": "causal" if layer.window is None else f"window {layer.window}", "P": p,
                                 "method": method, "compute ms": m["compute s"] * 1e3,
                                 "shard transfer ms": m["transfer s"] * 1e3, "time ms": m["time s"] * 1e3,
                                 "transfer hidden": "yes" if m["hidden"] else "no",
                                 "sent MiB": m["sent bytes"] / 2**20, "memory MiB": m["memory bytes"] / 2**20})
    return rows


def long_context_layers() -> list[Layer]:
    """Llama-3-8B-like attention (Hq 32, Hkv 8, D 128, bf16) at 128k and 1M tokens, causal and window 4,096."""
    base = Layer(131072)
    return [base, replace(base, length=1 << 20), replace(base, window=4096), replace(base, length=1 << 20,
                                                                                      window=4096)]


def model_main(args, out) -> list:
    """``--model``: the projections, and the check against a measured run (``--measured``: its cp_summary.json).
    Returns the paths written."""
    import json
    import os

    from lab import plots
    from lab.measure import format_table, machine_info, save_results

    projections = projection_rows(long_context_layers(), [8, 64, 512, 1024])
    columns = ["hardware", "T", "mask", "P", "method", "compute ms", "shard transfer ms", "time ms", "transfer hidden",
               "sent MiB", "memory MiB"]
    print("scale model, one forward attention layer per rank (Hq 32, Hkv 8, D 128, bf16; module docstring):\n")
    print(format_table(projections, columns))
    checks = []
    if args.measured:
        measured = json.loads(open(args.measured).read())
        cores = os.cpu_count() or 1
        checks = check_rows(measured["rows"], measured["meta"]["settings"], args.link_gbs * 1e9, cores)
        print(f"\nthe model beside the measured run {args.measured} (FLOP rate from each mask's single process, "
              f"link {args.link_gbs} GB/s, {cores} cores shared by the P processes):\n")
        print(format_table(checks, list(checks[0]) if checks else []))
    meta = {**machine_info(), "command": "python run.py bench cp --model", "hardware": [h.__dict__ for h in HARDWARE]}
    paths = save_results(out, "cp_model", projections, meta)
    if checks:
        paths += save_results(out, "cp_model_check", checks, meta)
    fig, axes = plots.figure(ncols=2, width=5.0)
    for ax, hardware in zip(axes, HARDWARE):
        for index, (mask, method) in enumerate((("causal", "ring"), ("causal", "allgather"),
                                                ("window 4096", "ring"), ("window 4096", "direct"))):
            mine = [r for r in projections if r["hardware"] == hardware.name and r["T"] == 1 << 20
                    and r["mask"] == mask and r["method"] == method]
            plots.series(ax, [r["P"] for r in mine], [r["time ms"] for r in mine], f"{method}, {mask}", index)
        plots.loglog(ax, hardware.name, "processes P", "forward ms per layer, T = 1M")
    paths.append(plots.save(fig, out / "cp_model.png"))
    return paths
