"""run.py bench cp --model: the scale model's bytes equal the measured bench's formula (lab.bench.cp_worker,
which counted bytes match exactly), its time and memory behave as stated, and the command writes its files."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from lab.bench import cp, cp_model
from lab.bench.cp_worker import expected_bytes


@pytest.mark.parametrize("procs", [2, 4, 8])
@pytest.mark.parametrize("method, window", [("ring", None), ("allgather", None), ("ring", 64), ("direct", 64),
                                            ("direct", None)])
def test_the_models_forward_bytes_equal_the_benchs_formula(procs, method, window):
    length = 1024
    settings = dict(batch=1, kv_heads=2, head_dim=16)
    if window is None:  # causal: the bench's zigzag shards, every one seen
        chunk = length // (2 * procs)
        positions = [torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (r, 2 * procs - 1 - r)])
                     for r in range(procs)]
    else:
        positions = list(torch.tensor_split(torch.arange(length), procs))
    want = expected_bytes(method, 0, [len(x) for x in positions], settings, positions, window)[0]  # (not the last)
    layer = cp_model.Layer(length, 1, 4, 2, 16, 4, window)
    got = cp_model.predict(layer, procs, method, cp_model.Hardware("any", 1e12, 1e9))["sent bytes"]
    assert got == want


def test_time_memory_and_hiding_follow_the_stated_model():
    hardware = cp_model.Hardware("test", 1e12, 1e9)
    causal = cp_model.Layer(1 << 16, heads=8, kv_heads=2, head_dim=64)
    one = cp_model.predict(causal, 1, "ring", hardware)
    ring, gather = (cp_model.predict(causal, 8, m, hardware) for m in ("ring", "allgather"))
    assert ring["compute s"] == pytest.approx(one["compute s"] / 8)  # balanced (zigzag)
    assert ring["time s"] >= ring["compute s"] and gather["time s"] >= gather["compute s"]
    assert ring["memory bytes"] < gather["memory bytes"]  # one shard in flight, not all of them
    slow = cp_model.Hardware("slow link", 1e12, 1e6)
    assert cp_model.predict(causal, 8, "ring", hardware)["hidden"] == 1.0  # fast link: compute hides the ring
    assert cp_model.predict(causal, 8, "ring", slow)["hidden"] == 0.0
    window = cp_model.Layer(1 << 16, heads=8, kv_heads=2, head_dim=64, window=512)
    direct, ring_w = (cp_model.predict(window, 8, m, slow) for m in ("direct", "ring"))
    assert direct["sent bytes"] < ring_w["sent bytes"] and direct["time s"] < ring_w["time s"]


def test_the_model_command_projects_and_checks_a_measured_run(tmp_path, capsys):
    measured = tmp_path / "cp_summary.json"
    settings = dict(length=512, batch=1, heads=4, kv_heads=2, head_dim=16, window=64)
    rows = [dict(mask="causal", method="single", P=1, **{"fwd ms": 10.0}),
            dict(mask="causal", method="ring", P=2, **{"fwd ms": 6.0})]
    measured.write_text(json.dumps({"rows": rows, "meta": {"settings": settings}}))
    parser = argparse.ArgumentParser()
    cp.add_arguments(parser)
    args = parser.parse_args(["--model", "--measured", str(measured), "--out", str(tmp_path)])
    assert cp.main(args) == 0
    projections = json.loads((tmp_path / "cp_model.json").read_text())["rows"]
    assert {r["P"] for r in projections} == {8, 64, 512, 1024}
    check = json.loads((tmp_path / "cp_model_check.json").read_text())["rows"]
    assert [(r["method"], r["P"]) for r in check] == [("ring", 2)] and check[0]["measured fwd ms"] == 6.0
    assert (tmp_path / "cp_model.png").stat().st_size > 0
    assert "scale model" in capsys.readouterr().out
