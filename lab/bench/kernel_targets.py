"""The targets of ``run.py bench kernels``: each checked against the peer measured in the same run, on CPU
(``check_targets``) and on CUDA (``check_cuda_targets``)."""

from __future__ import annotations

import math
from typing import Any

from lab.measure import paired_ratio

SDPA_CUDA_BACKENDS = ("sdpa flash", "sdpa cudnn", "sdpa efficient")  # on CUDA "vs sdpa" is the best of them


def find_rows(rows, group, impl_prefix, case_part=None):
    return [r for r in rows if r["group"] == group and r["impl"].startswith(impl_prefix) and "ms" in r
            and (case_part is None or case_part in r["case"])]


def _ratio_rows(rows, group, peer_prefix, case_part=None):
    """``(case, peer ms / engine ms)`` for every case of a group that has both."""
    out = []
    for engine in find_rows(rows, group, "engine (", case_part):
        peer = [r for r in find_rows(rows, group, peer_prefix) if r["case"] == engine["case"]]
        if peer:
            out.append((engine["case"], peer[0]["ms"] / engine["ms"]))
    return out


def _adder(targets: list[dict[str, Any]]):
    """``add(name, [(case, value), ...], threshold, how)``: record a target's worst case (skipped if unmeasured)."""

    def add(name, pairs, threshold, how):
        if pairs:
            case, value = min(pairs, key=lambda p: p[1])
            targets.append({"target": name, "measured": value, "threshold": threshold, "met": value >= threshold,
                            "how": f"{how}; worst: {case}"})

    return add


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 4's targets (and issue 13's) as measured in this run: the worst case of each, with the threshold."""
    targets: list[dict[str, Any]] = []
    add = _adder(targets)

    add("1 prefill vs sdpa is_causal", _ratio_rows(rows, "prefill", "sdpa is_causal"), 0.95, "throughput ratio")
    add("2 chunked vs sdpa dense", _ratio_rows(rows, "chunked", "sdpa dense"), 1.5, "speed-up")
    add("2 chunked vs flex", _ratio_rows(rows, "chunked", "flex"), 1.0, "speed-up")
    add("3 window vs sdpa dense", _ratio_rows(rows, "window", "sdpa dense", "T=16384"), 8.0, "speed-up at T=16k")
    add("3 window vs flex", _ratio_rows(rows, "window", "flex"), 1.0, "speed-up")
    window = sorted((r["T"], r["ms"]) for r in find_rows(rows, "window", "engine ("))
    if len(window) >= 2:
        exponent = fitted_exponent([t for t, _ in window], [ms for _, ms in window])
        targets.append({"target": "3 window time ~ T^e", "measured": exponent, "threshold": 1.15,
                        "met": exponent <= 1.15, "how": f"fitted over T={window[0][0]}..{window[-1][0]} (at most)"})
    add("4 documents vs sdpa dense", _ratio_rows(rows, "documents", "sdpa dense"), 8.0, "speed-up")
    add("4 documents vs flex", _ratio_rows(rows, "documents", "flex"), 1.0, "speed-up")
    add("5 decode K/V GB/s / copy GB/s", _of_copy_bandwidth(rows), 0.8,
        "bytes of K and V read per second over the copy bandwidth")
    add("5 decode vs sdpa enable_gqa", _ratio_rows(rows, "decode", "sdpa enable_gqa"), 1.0, "speed-up")
    _decode_targets(rows, add)
    _bandwidth_targets(rows, add)
    for r in find_rows(rows, "memory", "engine ("):
        targets.append({"target": "6 memory, peak extra GiB", "measured": r["peak MiB"] / 1024, "threshold": 1.0,
                        "met": r["peak MiB"] / 1024 < 1.0, "how": f"{r['case']}, {r['impl']}, below threshold"})
    add("7 training vs sdpa is_causal", _ratio_rows(rows, "training", "sdpa is_causal"), 0.8, "throughput ratio")
    add("7 training window/docs vs sdpa dense", _ratio_rows(rows, "training", "sdpa dense"), 4.0, "speed-up")
    return targets


def check_cuda_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 11's GPU targets as measured in this run: the worst case of each, with the threshold."""
    targets: list[dict[str, Any]] = []
    add = _adder(targets)

    def vs_best_sdpa(group):
        out = []
        for engine in find_rows(rows, group, "engine ("):
            peers = [r["ms"] for r in rows if r["case"] == engine["case"] and r["group"] == group
                     and r["impl"].startswith(SDPA_CUDA_BACKENDS) and "ms" in r]
            if peers:
                out.append((engine["case"], min(peers) / engine["ms"]))
        return out

    add("GPU 1 causal vs SDPA's best backend", vs_best_sdpa("prefill"), 0.95, "throughput ratio")
    groups = ("chunked", "window", "documents", "ragged")
    masks = [pair for group in groups for pair in _ratio_rows(rows, group, "flex")]
    add("GPU 2 masks vs FlexAttention called directly", masks, 0.95, "throughput ratio (block-mask build apart)")
    add("GPU 3 decode K/V GB/s / copy GB/s", _of_copy_bandwidth(rows), 0.7,
        "bytes of K and V read per second over the measured copy bandwidth")
    add("GPU training causal vs SDPA's best", vs_best_sdpa("training"), 0.95, "throughput ratio")
    add("GPU training masks vs Flex direct", _ratio_rows(rows, "training", "flex"), 0.95, "throughput ratio")
    return targets


def _decode_targets(rows, add) -> None:
    """The native decode kernel's targets: K/V read at >= 60 % of the copy bandwidth at S >= 32k; an int8 cache at
    <= 0.6x the bf16 cache's time at S = 32k (a speed-up >= 1 / 0.6); fp16 decode at least level with bf16."""
    cases = {r["case"]: r["S"] for r in find_rows(rows, "decode", "engine (")}
    add("13 decode K/V GB/s / copy, S >= 32k", [(case, ratio) for case, ratio in _of_copy_bandwidth(rows)
                                               if cases[case] >= 32768], 0.6,
        "bytes of K and V read per second over the copy bandwidth (stretch 0.8)")
    bf16 = {(r["B"], r["S"]): r for r in find_rows(rows, "decode", "engine (") if r["dtype"] == "torch.bfloat16"}
    add("13 int8 cache vs bf16 cache, S = 32k",
        [(r["case"], bf16[(r["B"], r["S"])]["ms"] / r["ms"]) for r in find_rows(rows, "decode", "engine int8")
         if r["S"] == 32768 and (r["B"], r["S"]) in bf16], 1 / 0.6, "speed-up (time <= 0.6x bf16's)")
    add("13 fp16 decode vs bf16", [(r["case"], bf16[(r["B"], r["S"])]["ms"] / r["ms"])
                                   for r in find_rows(rows, "decode", "engine (") if r["dtype"] == "torch.float16"
                                   and (r["B"], r["S"]) in bf16], 1.0, "speed-up (>= 1: level or faster)")


def _bandwidth_targets(rows, add) -> None:
    """Issue 29's targets (group "bandwidth"): K/V read from the caches' buffers at >= 70 % of the copy bandwidth
    in every dtype; 2 threads >= 1.6x one; an int8 / fp8 cache >= 1.6x bf16's keys per second (the worst of one
    thread's and two threads' ratios, where the 2-thread rows were measured). The 2 threads'
    line says how much faster than one thread's kernel the machine can read the same bytes on 2 threads at all
    (the "read, 2 threads" rows: the most any 2-thread kernel could gain), where measured."""
    def of(prefix):
        return {r["case"]: r for r in find_rows(rows, "bandwidth", prefix)}

    def exactly(impl):
        return {r["case"]: r for r in find_rows(rows, "bandwidth", impl) if r["impl"] == impl}
    one, two, copies, reads = of("engine ("), of("engine, 2 threads"), of("copy"), of("read, 2 threads")

    def of_copy(r, copy):  # (bytes / s) / (copy bytes / s), the times' ratio taken repeat by repeat
        return r["GB/s"] * r["ms"] / (copy["GB/s"] * copy["ms"]) / time_ratio(r, copy)
    add("29 decode K/V GB/s / copy", [(c, of_copy(r, copies[c])) for c, r in one.items() if c in copies], 0.7,
        "one thread, K/V in the caches' buffers (stretch 0.85)")
    ceiling = [time_ratio(one[c], r) for c, r in reads.items() if c in one]
    add("29 decode 2 threads vs 1", [(c, time_ratio(one[c], r)) for c, r in two.items() if c in one], 1.6,
        "speed-up" + (f" (reading the bytes alone on 2 threads: {min(ceiling):.2f}-{max(ceiling):.2f}x one thread's "
                      f"kernel)" if ceiling else ""))
    for kind in ("int8", "fp8"):  # (each thread count against the bf16 cache's on as many)
        add(f"29 {kind} cache vs bf16, keys/s",
            [(c, time_ratio(one[c], r)) for c, r in exactly(f"engine {kind} cache").items() if c in one] +
            [(f"{c}, 2 threads", time_ratio(two[c], r)) for c, r in exactly(f"engine {kind} cache, 2 threads").items()
             if c in two], 1.6, "speed-up over the bf16 cache, on 1 and 2 threads")


def time_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Row a's time over row b's: the median of the repeats' ratios where both rows kept their repeats (``round ms``,
    timed in the same rounds: ``lab.measure.paired_ratio``), else the ratio of their medians."""
    ra, rb = a.get("round ms"), b.get("round ms")
    if ra and rb and len(ra) == len(rb):
        return paired_ratio(ra, rb)
    return a["ms"] / b["ms"]


def _of_copy_bandwidth(rows) -> list[tuple[str, float]]:
    """Each decode case's engine K/V GB/s over the copy bandwidth measured in the same case."""
    copies = {r["case"]: r["GB/s"] for r in find_rows(rows, "decode", "copy")}
    return [(r["case"], r["GB/s"] / copies[r["case"]]) for r in find_rows(rows, "decode", "engine (")
            if r["case"] in copies]


def fitted_exponent(ts: list[int], ms: list[float]) -> float:
    from lab.fitting import fit_power_law

    return fit_power_law(ts, ms)[0] if len(ts) >= 2 else math.nan
