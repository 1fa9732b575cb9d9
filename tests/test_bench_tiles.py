"""``run.py bench tiles --quick``: each case run with the AMX-BF16 tiles and without in one process, a table, JSON, CSV
and a plot; where the library has no tiles it says so and times nothing."""

import argparse
import json

import torch

from engine.kernels.decode.native_build import load_native
from lab.bench import tiles as bench_tiles

LIBRARY = load_native()
TILES = not isinstance(LIBRARY, str) and LIBRARY.bf16_tiles


def test_the_quick_run_times_every_case_both_ways_and_writes_its_files(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_tiles.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--quiet", "--threads", "1"])
    assert bench_tiles.main(args) == 0
    if not TILES:  # (a CPU without them: nothing timed, and the bench says why)
        assert "no AMX-BF16 tiles here" in capsys.readouterr().out and not (tmp_path / "tiles.json").exists()
        return
    rows = json.loads((tmp_path / "tiles.json").read_text())["rows"]
    assert len(rows) == len(bench_tiles.cases(True, torch.Generator().manual_seed(0)))
    for row in rows:
        assert row["kernel"] == "decode_native" and row["on the tiles"] is True, row
        assert row["tiles ms"] > 0 and row["vector path ms"] > 0
        assert row["max |diff|"] < 0.05, row  # (both rounded to bf16: a rounding's difference at most)
    assert LIBRARY.bf16_tiles  # (turned back on after the runs)
    assert (tmp_path / "tiles.csv").exists() and (tmp_path / "tiles.png").exists()
