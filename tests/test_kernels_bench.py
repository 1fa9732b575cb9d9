"""``run.py bench kernels``: the machinery runs, rows carry ratios, targets are read from the rows."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from lab.bench import kernels as bench_kernels
from lab.bench.kernel_cases import Case, Impl, causal_pairs, window_pairs
from lab.measure import interleaved_rounds, paired_ratio


def test_useful_work_counts_visible_pairs():
    assert causal_pairs(4) == 10  # 1 + 2 + 3 + 4
    assert window_pairs(6, 3) == 1 + 2 + 3 + 3 + 3 + 3
    assert window_pairs(100, 3) == sum(min(i + 1, 3) for i in range(100))


def test_a_case_gives_one_row_per_implementation_with_ratios_to_the_peers():
    x = torch.randn(64, 64)
    case = Case("window", "toy", {"T": 64, "window": 8},
                lambda: [Impl("engine (toy)", lambda: x @ x), Impl("sdpa dense mask", lambda: (x @ x) @ x, "peer")],
                flops=2 * 64 ** 3)
    rows = bench_kernels.run_case(case, repeats=2, wanted=None)
    assert [r["impl"] for r in rows] == ["engine (toy)", "sdpa dense mask"]
    assert all(r["ms"] > 0 and r["GFLOP/s"] > 0 and r["runs"] == 2 for r in rows)
    assert rows[0]["vs dense"] == rows[1]["ms"] / rows[0]["ms"]
    assert "vs dense" not in rows[1]  # peers carry no ratio to themselves


def test_a_read_row_counts_the_cases_kv_bytes_and_no_flops():
    from lab.bench.kernel_cases_decode import _read

    k, v = torch.ones(2, 4, 8, 16, dtype=torch.bfloat16), torch.full((2, 4, 8, 16), 2.0, dtype=torch.bfloat16)
    sums = _read(k, v)  # every 4-byte word once: two bf16 values per fp32 word, read as one number
    assert len(sums) == 2 and all(s.dtype == torch.float32 for s in sums)
    assert sums[0].item() == (k.view(torch.float32).double().sum()).item()
    case = Case("bandwidth", "toy", {}, lambda: [Impl("read, 1 thread", lambda: _read(k, v), "read")], flops=1.0,
                kv_bytes=float(k.nbytes + v.nbytes))
    row = bench_kernels.run_case(case, repeats=2, wanted=None)[0]
    assert row["GB/s"] == pytest.approx((k.nbytes + v.nbytes) / (row["ms"] / 1e3) / 1e9)
    assert "GFLOP/s" not in row and "vs sdpa" not in row


def test_a_cold_case_clears_the_caches_before_every_call_and_others_do_not(monkeypatch):
    events = []
    monkeypatch.setattr(bench_kernels, "evict_caches", lambda: events.append("evict"))
    impls = lambda: [Impl("a", lambda: events.append("a")), Impl("b", lambda: events.append("b"))]  # noqa: E731
    bench_kernels.run_case(Case("bandwidth", "toy", {}, impls, flops=1.0, cold=True), repeats=2, wanted=None)
    assert events == ["evict", "a", "evict", "b"] * 3  # the first calls, then two rounds, each after a clearing
    events.clear()
    bench_kernels.run_case(Case("bandwidth", "toy", {}, impls, flops=1.0), repeats=2, wanted=None)
    assert events == ["a", "b"] * 3


def test_the_caches_are_cleared_by_a_buffer_twice_the_last_level_cache_within_256_to_512_mib():
    from lab import measure

    assert measure.last_level_cache_bytes() >= 0
    measure._EVICTION.clear()
    measure.evict_caches()
    size = measure._EVICTION[0].nbytes
    assert (256 << 20) <= size <= (512 << 20)
    assert size == min(max(2 * measure.last_level_cache_bytes(), 256 << 20), 512 << 20)
    assert measure._EVICTION[0][0].item() == 1.0  # written: every word once per clearing
    measure.evict_caches()
    assert measure._EVICTION[0][-1].item() == 2.0
    measure._EVICTION.clear()


def test_targets_take_the_worst_case_and_say_whether_it_is_met():
    def row(group, case, impl, ms, **extra):
        return {"group": group, "case": case, "impl": impl, "ms": ms, "role": "peer", **extra}
    rows = [row("prefill", "causal T=1024", "engine (sdpa)", 10.0),
            row("prefill", "causal T=1024", "sdpa is_causal", 10.0),
            row("prefill", "causal T=2048", "engine (sdpa)", 40.0),
            row("prefill", "causal T=2048", "sdpa is_causal", 36.0),
            row("window", "window 512, T=16384", "engine (sdpa_tiles)", 100.0, T=16384),
            row("window", "window 512, T=16384", "sdpa dense mask", 1000.0, T=16384),
            row("window", "window 512, T=4096", "engine (sdpa_tiles)", 25.0, T=4096)]
    targets = {t["target"]: t for t in bench_kernels.check_targets(rows)}
    prefill = targets["1 prefill vs sdpa is_causal"]
    assert prefill["measured"] == 0.9 and not prefill["met"] and "T=2048" in prefill["how"]
    assert targets["3 window vs sdpa dense"]["measured"] == 10.0 and targets["3 window vs sdpa dense"]["met"]
    assert abs(targets["3 window time ~ T^e"]["measured"] - 1.0) < 1e-9


def test_the_quick_decode_run_writes_json_and_plots(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    args = parser.parse_args(["--quick", "--groups", "decode", "--out", str(tmp_path), "--quiet"])
    assert bench_kernels.main(args) == 0
    saved = json.loads((tmp_path / "kernels.json").read_text())
    impls = {r["impl"] for r in saved["rows"]}
    assert {"engine (decode_native)", "engine:decode", "engine int8 cache", "sdpa enable_gqa", "copy"} <= impls
    assert any(t["target"].startswith("5 decode") for t in saved["meta"]["targets"])
    assert (tmp_path / "kernels_decode.png").exists()
    assert "5 decode vs sdpa enable_gqa" in capsys.readouterr().out


def test_the_quick_scores_run_times_the_native_kernel_beside_the_paths_before_and_the_peers_and_plots_them(tmp_path):
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    args = parser.parse_args(["--quick", "--groups", "scores", "--out", str(tmp_path), "--quiet"])
    assert bench_kernels.main(args) == 0
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {r["group"] for r in rows} == {"scores"}
    impls = {r["impl"] for r in rows}
    assert {"engine:tiled", "engine, no softcap", "eager softcap", "engine:decode", "engine, no alibi",
            "eager alibi", "sdpa alibi mask", "engine, no bias", "eager bias", "sdpa bias mask",
            "engine paged, pages of 16", "engine paged, no softcap", "engine paged, no alibi"} <= impls
    assert any(i in impls for i in ("engine (decode_native)", "engine (tiled)"))  # (tiled where no compiler)
    assert all(r["ms"] > 0 for r in rows)
    assert (tmp_path / "kernels_scores.png").stat().st_size > 0


def test_device_cuda_without_a_gpu_says_so_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    assert bench_kernels.main(parser.parse_args(["--device", "cuda", "--out", str(tmp_path), "--quiet"])) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().out


def test_the_gpu_cases_are_the_issues_and_build_nothing_until_run():
    from lab.bench.kernel_cases_cuda import cuda_cases

    cases = cuda_cases(quick=False)  # builds no tensor: every case makes its inputs when it runs
    names = {(c.group, c.name) for c in cases}
    assert {("prefill", f"causal T={t}") for t in (4096, 8192, 16384, 32768)} <= names
    assert ("window", "window 4096, T=32768") in names and ("documents", "64 docs x 512, T=32768") in names
    assert {("decode", f"B={b} S={s}") for b in (8, 64) for s in (32768, 131072)} <= names
    assert {"chunked", "ragged", "training"} <= {c.group for c in cases}


def test_gpu_targets_compare_with_the_best_sdpa_backend_and_flex_called_directly():
    def row(group, case, impl, ms, **extra):
        return {"group": group, "case": case, "impl": impl, "ms": ms, "role": "peer", **extra}
    rows = [row("prefill", "causal T=4096", "engine (sdpa_cuda)", 10.0),
            row("prefill", "causal T=4096", "sdpa flash", 12.0),
            row("prefill", "causal T=4096", "sdpa cudnn", 9.0),  # the best backend is the peer
            row("window", "window 4096, T=32768", "engine (flex)", 20.0),
            row("window", "window 4096, T=32768", "flex (direct)", 19.0),
            row("decode", "B=8 S=32768", "engine (sdpa_cuda)", 1.0, **{"GB/s": 3000.0}),
            row("decode", "B=8 S=32768", "copy", 1.0, **{"GB/s": 4000.0})]
    targets = {t["target"]: t for t in bench_kernels.check_cuda_targets(rows)}
    assert targets["GPU 1 causal vs SDPA's best backend"]["measured"] == 0.9
    assert not targets["GPU 1 causal vs SDPA's best backend"]["met"]
    assert targets["GPU 2 masks vs FlexAttention called directly"]["measured"] == 19.0 / 20.0
    assert targets["GPU 3 decode K/V GB/s / copy GB/s"]["measured"] == 0.75
    assert targets["GPU 3 decode K/V GB/s / copy GB/s"]["met"]


def test_bandwidth_targets_read_the_caches_rows_two_threads_and_quantized_caches():
    def row(case, impl, ms, gbs=None):
        return {"group": "bandwidth", "case": case, "impl": impl, "ms": ms, "role": "engine",
                **({"GB/s": gbs} if gbs is not None else {})}
    rows = [row("a", "engine (decode_native), cache buffers", 10.0, 10.0), row("a", "engine, 2 threads", 5.0),
            row("a", "engine, caller's tensors", 12.0, 8.0), row("a", "engine int8 cache", 5.0),
            row("a", "copy", 1.0, 12.5),
            row("b", "engine (decode_native), cache buffers", 10.0, 7.0), row("b", "engine, 2 threads", 8.0),
            row("b", "copy", 1.0, 14.0), row("b", "read, 2 threads", 6.0), row("a", "read, 2 threads", 4.0),
            row("a", "engine int8 cache, 2 threads", 2.0)]
    targets = {t["target"]: t for t in bench_kernels.check_targets(rows)}
    copy = targets["29 decode K/V GB/s / copy"]
    assert copy["measured"] == 0.5 and not copy["met"] and "worst: b" in copy["how"]  # b: 7 / 14
    threads = targets["29 decode 2 threads vs 1"]
    assert threads["measured"] == 1.25 and not threads["met"] and "worst: b" in threads["how"]
    # one thread's kernel time over reading the same bytes on 2 threads: a 10 / 4, b 10 / 6
    assert "reading the bytes alone on 2 threads: 1.67-2.50x one thread's kernel" in threads["how"]
    int8 = targets["29 int8 cache vs bf16, keys/s"]  # one thread 10 / 5; 2 threads 5 / 2 (the 2-thread rows' own)
    assert int8["measured"] == 2.0 and int8["met"] and int8["how"].endswith("worst: a")
    rows[-1]["ms"] = 4.0  # 2 threads 5 / 4: the worst, named as such
    int8 = {t["target"]: t for t in bench_kernels.check_targets(rows)}["29 int8 cache vs bf16, keys/s"]
    assert int8["measured"] == 1.25 and not int8["met"] and int8["how"].endswith("worst: a, 2 threads")
    assert "29 fp8 cache vs bf16, keys/s" not in targets  # not measured: no row, no target


def test_bandwidth_targets_take_ratios_repeat_by_repeat_where_rows_kept_their_repeats():
    # the machine slowed 2x for the last two repeats: each row's median falls in a different stretch (copy's in the
    # fast one, the engine's in the slow one), but within every repeat the engine took 2x the copy's time and the
    # int8 cache half the bf16 cache's
    def row(impl, rounds, gbs=None):
        return {"group": "bandwidth", "case": "a", "impl": impl, "role": "engine", "ms": sorted(rounds)[1],
                "round ms": rounds, **({"GB/s": gbs} if gbs is not None else {})}
    engine_rounds, copy_rounds = [2.0, 4.0, 4.0], [1.0, 1.0, 2.0]
    rows = [row("engine (decode_native), cache buffers", engine_rounds, 10.0 / 4.0),  # GB/s of the median, 4 ms
            row("engine int8 cache", [1.0, 2.0, 2.0]), row("engine, 2 threads", [1.0, 2.0, 2.0]),
            row("copy", copy_rounds, 10.0 / 1.0)]  # (the same bytes as the engine's K/V, for the check below)
    targets = {t["target"]: t for t in bench_kernels.check_targets(rows)}
    assert targets["29 decode K/V GB/s / copy"]["measured"] == 0.5  # each repeat: twice the copy's time
    assert targets["29 int8 cache vs bf16, keys/s"]["measured"] == 2.0
    assert targets["29 decode 2 threads vs 1"]["measured"] == 2.0
    unpaired = [{k: v for k, v in r.items() if k != "round ms"} for r in rows]  # without repeats: the medians
    assert {t["target"]: t for t in bench_kernels.check_targets(unpaired)}["29 decode K/V GB/s / copy"][
        "measured"] == 0.25


def test_paired_ratio_is_the_median_of_each_rounds_ratio_and_refuses_unpaired_lists():
    # rounds' ratios 1, 3, 2: their median is 2 where the medians' ratio would be 3 / 1
    assert paired_ratio([1.0, 3.0, 10.0], [1.0, 1.0, 5.0]) == 2.0
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_ratio([1.0, 2.0], [1.0])
    calls = []
    rounds = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, 2, warmup=1)
    assert [len(rounds["a"]), len(rounds["b"])] == [3, 3] and calls.count("a") == calls.count("b") == 1 + 3 * 2
    assert calls[2:] == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]  # the order rotates by round
    # with `before`: it runs (untimed) before every timed call, and each call is timed on its own
    calls.clear()
    rounds = interleaved_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, 2, warmup=0,
                                before=lambda: calls.append("clear"))
    assert [len(rounds["a"]), len(rounds["b"])] == [2, 2]
    assert calls == ["clear", "a"] * 2 + ["clear", "b"] * 4 + ["clear", "a"] * 2
