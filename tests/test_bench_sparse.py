"""``run.py bench sparse --quick``: the sparse kernel, the native listed path, auto and the dense-mask peer on the
same calls, a table, JSON, CSV and a plot."""

import argparse
import json

from lab.bench import sparse as bench_sparse


def test_the_quick_run_times_sparse_against_the_dense_mask_and_writes_its_files(tmp_path):
    parser = argparse.ArgumentParser()
    bench_sparse.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--quiet"])
    assert bench_sparse.main(args) == 0
    rows = json.loads((tmp_path / "sparse.json").read_text())["rows"]
    prefill = [r for r in rows if r["group"] == "prefill"]
    assert {r["impl"] for r in prefill} == {"engine sparse", "engine native listed", "engine auto", "sdpa dense mask"}
    assert all(r["max |diff|"] < 1e-4 for r in prefill)  # the same attention every way
    carried = [r for r in prefill if r["target"]]  # the native row, timed with its plan made
    assert {r["impl"] for r in carried} == {"engine native listed"} and all(r["plan + run ms"] > 0 for r in carried)
    decode = [r for r in rows if r["group"] == "decode"]
    assert {r["impl"] for r in decode} == {"engine sparse", "engine native listed", "engine paged listed",
                                           "engine auto", "dense decode over K keys"}
    paged = [r for r in decode if r["impl"] == "engine paged listed"]
    assert all(r["kernel"].startswith("native in place") and float(r["kernel"].split()[-1][:-1]) < 1e-5 for r in paged)
    assert all(r["met"] in ("yes", "no") for r in rows if r["target"])
    assert (tmp_path / "sparse.csv").exists() and (tmp_path / "sparse.png").exists()
