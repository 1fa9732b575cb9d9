"""Each bench command runs at its --quick size into a temporary folder and writes its results and plot.

No timing is asserted (benchmarks are not tests); what is asserted is deterministic: which implementations
ran, counted FLOPs and bytes, allocator-exact memory growth, and the files.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from engine.kernels.dispatch import KERNELS
from engine.planning import explain
from lab.bench import gqa, roofline, scaling
from lab.fitting import fit_power_law
from lab.implementations import PEER


def run(module, *flags: str) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return module.main(parser.parse_args(list(flags)))


def rows_of(path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_bench_scaling_quick_measures_every_registered_kernel_and_the_peer(tmp_path, capsys):
    assert run(scaling, "--quick", "--quiet", "--out", str(tmp_path)) == 0
    for name in ("scaling.json", "scaling.csv", "scaling_fits.json", "scaling_fits.csv", "scaling.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    fits = {f["impl"]: f for f in rows_of(tmp_path / "scaling_fits.json")}
    assert set(fits) == {"engine:auto", PEER} | {f"engine:{k}" for k in KERNELS}
    # Allocator-exact memory: the reference materialises [B, H, T, T] scores, so what it allocates grows ~T^2.
    points = [r for r in rows_of(tmp_path / "scaling.json") if r["impl"] == "engine:reference"]
    exponent, _ = fit_power_law([r["T"] for r in points], [r["alloc_MiB"] for r in points])
    assert exponent > 1.8
    largest = max(points, key=lambda r: r["T"])
    assert largest["alloc_MiB"] * 2**20 >= largest["T"] ** 2 * 4  # at least one fp32 T x T matrix was held
    assert fits["engine:reference"]["memory_exponent"] > fits[PEER]["memory_exponent"]
    assert "fits_until_T" in capsys.readouterr().out


def test_bench_scaling_rejects_an_unparsable_memory_size(capsys):
    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--memory", "80 gigs"])
    assert "expected a size like '80GiB'" in capsys.readouterr().err
    assert parser.parse_args(["--memory", "80GiB"]).memory == 80 * 2**30


def test_bench_scaling_rejects_unknown_implementations(tmp_path, capsys):
    assert run(scaling, "--quick", "--quiet", "--impl", "nope", "--out", str(tmp_path)) == 2
    assert "unknown implementation(s) nope; available:" in capsys.readouterr().out


def test_bench_roofline_quick_writes_machine_peaks_and_both_phases(tmp_path):
    assert run(roofline, "--quick", "--quiet", "--out", str(tmp_path)) == 0
    for name in ("roofline.json", "roofline.csv", "roofline_machine.json", "roofline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    meta = json.loads((tmp_path / "roofline.json").read_text())["meta"]
    assert meta["peak_GFLOPs"] > 0 and meta["bandwidth_GBs"] > 0
    rows = rows_of(tmp_path / "roofline.json")
    assert {r["phase"] for r in rows} == {"prefill", "decode"}
    prefill = next(r for r in rows if r["phase"] == "prefill")
    decode = next(r for r in rows if r["phase"] == "decode")
    assert prefill["FLOP/B"] > 10 * decode["FLOP/B"]  # the shapes, not the timings, set intensity


def test_roofline_attention_cost_counts_causal_pairs_and_compulsory_bytes():
    flops, moved = roofline.attention_cost(batch=1, heads=1, t=4, s=4, d=2, element=4)
    assert flops == 4 * 2 * (1 + 2 + 3 + 4)  # query i sees i + 1 keys
    assert moved == (4 + 4 + 4 + 4) * 2 * 4  # q, k, v, out, each [4, 2] fp32
    flops, moved = roofline.attention_cost(batch=1, heads=8, t=1, s=1000, d=128, element=4)
    assert flops / moved == pytest.approx(0.5, rel=0.01)  # decode in fp32: 4 S D / (2 S D * 4 B)


def test_bench_gqa_quick_counts_the_seed_flops_and_kv_bytes(tmp_path, capsys):
    assert run(gqa, "--quick", "--quiet", "--out", str(tmp_path)) == 0
    assert (tmp_path / "gqa.png").stat().st_size > 0 and (tmp_path / "gqa.csv").exists()
    rows = rows_of(tmp_path / "gqa.json")
    impls = {r["impl"] for r in rows}
    assert {"grouped", "engine:reference", PEER} <= impls
    # engine:auto is counted unless the kernel it runs does its work outside aten ops (the native decode kernel)
    q, kv = torch.randn(1, 8, 1, 32, dtype=torch.bfloat16), torch.randn(1, 2, 512, 32, dtype=torch.bfloat16)  # --quick
    auto = explain(q, kv, kv).kernel
    assert ("engine:auto" in impls) == (f"engine:{auto}" not in gqa.UNCOUNTABLE), auto
    for r in rows:
        assert r["MFLOP"] == pytest.approx(r["formula_MFLOP"], rel=1e-12), r  # counted matmul FLOPs
        assert r["kv_read_MB"] >= r["formula_MB"]  # K and V read at least once (plus q)
    for name in ("grouped", PEER):  # each reads K and V exactly once: the seed's intensity, q adds under 2%
        for r in (r for r in rows if r["impl"] == name):
            assert r["intensity"] == pytest.approx(r["formula_intensity"], rel=0.02), r
    for name in impls:  # whatever a kernel re-reads, it re-reads per KV head: intensity ~ Hq / Hkv
        by_group = {r["G"]: r["intensity"] for r in rows if r["impl"] == name}
        assert by_group[8] / by_group[1] == pytest.approx(8, rel=0.02), name
    assert "intensity ~ G^" in capsys.readouterr().out


def test_bench_gqa_rejects_kv_heads_that_do_not_divide_q_heads(tmp_path, capsys):
    assert run(gqa, "--quiet", "--kv-heads", "3", "--out", str(tmp_path)) == 2
    assert "must divide --q-heads (32)" in capsys.readouterr().out
