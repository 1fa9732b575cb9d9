"""``run.py bench latent --quick``: the latent decode (shared rows, rows apart), the expanded cache, the usual decode
and the copy in one run, a table, JSON, CSV and a plot."""

import argparse
import json

from engine.kernels.decode.native_build import load_native
from lab.bench import latent as bench_latent

LIBRARY = load_native()
TILES = not isinstance(LIBRARY, str) and LIBRARY.bf16_tiles


def test_the_quick_run_times_every_row_and_writes_its_files(tmp_path):
    parser = argparse.ArgumentParser()
    bench_latent.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path), "--quiet", "--threads", "1"])
    assert bench_latent.main(args) == 0
    rows = json.loads((tmp_path / "latent.json").read_text())["rows"]
    assert len({r["case"] for r in rows}) == 4  # H 16 / 128 x fp32 / bf16
    for case in {r["case"] for r in rows}:
        mine = {r["impl"]: r for r in rows if r["case"] == case}
        impls = {"latent, shared rows", "latent, rows apart", "expanded cache", "contiguous decode", "copy"}
        if "bfloat16" in case and TILES:  # the same call on the vector path beside the tiles
            impls.add(bench_latent.VECTOR)
            assert mine[bench_latent.VECTOR]["equal to rows apart"] is None
        assert set(mine) == impls
        assert mine["latent, shared rows"]["equal to rows apart"] is True
        assert mine["latent, shared rows"]["met"] in ("yes", "no")
        heads = int(case.split()[1])
        ratio = mine["expanded cache"]["cache bytes / token"] / mine["latent, shared rows"]["cache bytes / token"]
        assert ratio == heads * (192 + 128) / 576  # the non-absorbed cache's bytes per token over the latent's
    assert (tmp_path / "latent.csv").exists() and (tmp_path / "latent.png").exists()
