"""``run.py bench cp`` at tiny sizes on 1 and 2 processes: every row is there, the bytes counted by wrapping
``torch.distributed`` equal the docstring's formula exactly (and hand-computed values), and a group that outlives
its deadline is killed instead of hanging. No timing is asserted (benchmarks are not tests)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from lab.bench import cp

TINY = ["--quick", "--quiet", "--procs", "1,2", "--length", "64", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "8", "--window", "16"]


def run(*flags: str) -> int:
    parser = argparse.ArgumentParser()
    cp.add_arguments(parser)
    return cp.main(parser.parse_args(list(flags)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bench_cp_quick_counts_exactly_the_formulas_bytes(tmp_path, capsys):
    assert run(*TINY, "--out", str(tmp_path)) == 0
    for name in ("cp.json", "cp.csv", "cp_summary.json", "cp_summary.csv", "cp.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = json.loads((tmp_path / "cp.json").read_text())["rows"]
    found = sorted((r["mask"], r["method"], r["P"], r["rank"]) for r in rows)
    expected = [(mask, "single", 1, 0) for mask in cp.MASKS]
    expected += [(mask, method, p, rank) for mask in cp.MASKS for method in cp.METHODS for p in (1, 2)
                 for rank in range(p)]
    assert found == sorted(expected)
    measured = [r for r in rows if r["method"] != "single"]
    assert all(r["exact"] for r in measured)
    assert all((r["sent fwd"], r["sent bwd"]) == (r["formula fwd"], r["formula bwd"]) for r in measured)
    # By hand, T=64 on 2 ranks: 32 keys each; one shard = K and V (2 x 32 x 8 fp32) + 32 int64 positions.
    shard, grads = 2 * 32 * 8 * 4 + 32 * 8, 2 * 32 * 8 * 4
    by_hand = {"ring": (shard, shard + 2 * grads),  # 1 move forward; back: K/V move once, dK/dV twice (home)
               "allgather": (shard, 2 * (32 * 8 * 4))}  # reduce_scatter of dK and dV: the other rank's slice each
    # direct: a shard goes only to a rank whose queries may see it. Zigzag (causal): both ranks read each other;
    # contiguous with window 16: rank 1's queries read rank 0's keys, rank 0's never read rank 1's (later keys)
    by_hand.update({("direct", "causal", 0): (shard, grads), ("direct", "causal", 1): (shard, grads),
                    ("direct", "window", 0): (shard, 0), ("direct", "window", 1): (0, grads)})
    for r in measured:
        want = by_hand[r["method"]] if r["method"] != "direct" else by_hand[("direct", r["mask"], r["rank"])]
        assert (r["sent fwd"], r["sent bwd"]) == (want if r["P"] == 2 else (0, 0)), r
    # The window's ring on contiguous shards computes only the shards its queries see: rank 0 sees only its own.
    window_ring = {r["rank"]: r for r in rows if (r["mask"], r["method"], r["P"]) == ("window", "ring", 2)}
    assert [(window_ring[k]["computed"], window_ring[k]["visible"]) for k in (0, 1)] == [(1, 1), (2, 2)]
    assert all(r["fwd ms"] > 0 and r["train MiB"] > 0 for r in rows)
    summary = json.loads((tmp_path / "cp_summary.json").read_text())["rows"]
    assert sorted((r["mask"], r["method"], r["P"]) for r in summary) == sorted({e[:3] for e in expected})
    out = capsys.readouterr().out
    assert "sent fwd MiB" in out and "x single train" in out


@pytest.mark.multiprocess
def test_bench_cp_kills_a_group_that_outlives_its_deadline(tmp_path, capsys):
    start = time.monotonic()
    assert run(*TINY, "--procs", "2", "--masks", "causal", "--deadline", "0.5", "--out", str(tmp_path)) == 1
    assert time.monotonic() - start < 30
    assert "killed after the 0.5 s deadline" in capsys.readouterr().out
