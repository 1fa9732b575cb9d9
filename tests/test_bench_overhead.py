"""``run.py bench overhead`` runs its calls group at a tiny size into a temporary folder and writes its files.

No timing is asserted (benchmarks are not tests): what is asserted is which implementations ran at which shapes,
that they agree with sdpa, and the files. The generate group loads a 100 MB model, so it is not run here.
"""

from __future__ import annotations

import argparse
import json

import torch

from lab.bench import overhead

IMPLS = {"engine causal_attention", "engine plan.run", "sdpa"}


def run(*flags: str) -> int:
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    return overhead.main(parser.parse_args(list(flags)))


def test_bench_overhead_calls_quick_times_three_implementations_per_shape(tmp_path, capsys):
    assert run("--groups", "calls", "--quick", "--quiet", "--rounds", "3", "--calls", "5", "--out", str(tmp_path)) == 0
    for name in ("overhead.json", "overhead.csv", "overhead.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "overhead.json").read_text())
    rows = saved["rows"]
    assert saved["meta"]["threads"] == 2  # the bench's default, not add_common's
    assert {r["case"] for r in rows} == {case for case, *_ in overhead.CALL_SHAPES + overhead.POSITION_CASES}
    position_cases = [(*case[:6], torch.float32) for case in overhead.POSITION_CASES]
    for case, batch, q_heads, kv_heads, keys, head_dim, dtype in overhead.CALL_SHAPES + position_cases:
        mine = {r["impl"]: r for r in rows if r["case"] == case}
        assert set(mine) == IMPLS | ({overhead.NEW_OBJECTS} if dtype == torch.float32 and case in dict(
            (c[0], c) for c in overhead.POSITION_CASES) else set()), case
        assert all(r["us/call"] > 0 and r["rounds"] == 3 for r in mine.values()), case
        assert mine["sdpa"]["time/sdpa"] == 1.0
        assert mine["sdpa"]["shape"] == f"q [{batch}, {q_heads}, 1, {head_dim}], k/v [{batch}, {kv_heads}, {keys}, " \
            f"{head_dim}]"
        assert mine["sdpa"]["dtype"] == str(dtype).removeprefix("torch.")
        for name, threshold in overhead.CALL_TARGETS.items():
            assert mine[name]["target"] == f"<= {threshold}x"
            assert mine[name]["met"] == ("yes" if mine[name]["time/sdpa"] <= threshold else "no")
            # the same attention: fp32 outputs, or bf16 ones rounded once (a step of bf16 near 1: 2^-7)
            assert mine[name]["max |diff|"] < (1e-5 if dtype == torch.float32 else 2 ** -6)
    csv_header = (tmp_path / "overhead.csv").read_text().splitlines()[0]
    assert "us/call" in csv_header and "time/sdpa" in csv_header
    out = capsys.readouterr().out
    assert "engine plan.run" in out and "targets met:" in out
    assert "loaded" not in out and "tok/s" not in out  # the generate group did not run


def test_positioned_gives_left_padded_rows_their_positions_and_mask():
    where = overhead.positioned(torch.tensor([5, 3]), 5)
    assert where["query_positions"].tolist() == [[4], [2]]
    assert where["key_positions"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]
    assert where["allowed"].to_dense().reshape(2, 5).tolist() == [[True] * 5, [False, False, True, True, True]]
    assert overhead.positioned(torch.tensor([5]), 5)["allowed"] is None  # no padding: the positions alone


def test_bench_overhead_rejects_unknown_groups(tmp_path, capsys):
    assert run("--groups", "calls,nope", "--out", str(tmp_path)) == 2
    assert "--groups takes a comma-separated list of calls, generate, got 'calls,nope'" in capsys.readouterr().out
