"""``run.py bench builds`` (lab/bench/builds.py): each build's plans run that build's library, a comparison that
would time one build twice stops, and the sources come from the revision asked for. The builds here are copies of
the library this machine already has (no compiler run)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.kernels.decode import native_build
from lab.bench import builds
from tests.test_decode_native import NATIVE, load_native

needs_native = pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")


def arguments(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    builds.add_arguments(parser)
    library = str(load_native().path)
    return parser.parse_args(["--library", library, "--library", library, "--quick", "--quiet", "--batch", "2",
                              "--pages", "16", "--out", str(tmp_path / "out"), *extra])


@needs_native
def test_each_build_runs_its_own_library_in_every_timed_call(tmp_path, monkeypatch):
    seen = []
    loaded = builds.load_build

    def recorded(label, path):
        build = loaded(label, path)
        seen.append(build)
        return build

    monkeypatch.setattr(builds, "load_build", recorded)
    args = arguments(tmp_path, "--kinds", "bf16,int8", "--rounds", "2")
    assert builds.main(args) == 0
    rows = json.loads((tmp_path / "out" / "builds.json").read_text())["rows"]
    assert [(r["case"], r["build"]) for r in rows][:2] == [("bf16 contiguous", seen[0].label),
                                                        ("bf16 contiguous", seen[1].label)]
    assert len(rows) == 3 * 4  # each case: the two builds, then the copy of its K/V bytes
    built, copies = [r for r in rows if r["vs first"] is not None], rows[2::3]
    assert len(built) == 2 * 4 and all(r["bitwise same"] for r in built)  # (the same code twice)
    assert all(r["build"].startswith("copy of the K/V bytes") and r["of copy"] == 1.0 for r in copies)
    assert all(len(r["round ms"]) == 2 and r["ms"] > 0 for r in rows)
    for i, row in enumerate(built):  # K/V bytes per second over the copy's (read + written) per second, per round
        copy = copies[i // 2]["round ms"]
        assert row["of copy"] == pytest.approx(statistics.median(c / t for c, t in zip(copy, row["round ms"])) / 2)
    assert seen[0].library is not seen[1].library and seen[0].library.lib._handle != seen[1].library.lib._handle
    # each case: one untimed call per build, then one per round; every one through the build's own library
    assert seen[0].calls == seen[1].calls == 4 * (1 + 2)
    assert (tmp_path / "out" / "builds.png").stat().st_size > 0


@needs_native
def test_a_plan_that_does_not_run_its_build_stops_the_bench(tmp_path, monkeypatch):
    @contextmanager
    def not_switched(build):  # every plan made under the library already loaded: one build timed twice
        yield

    monkeypatch.setattr(builds, "using", not_switched)
    with pytest.raises(RuntimeError, match="did not run its library"):
        builds.main(arguments(tmp_path, "--kinds", "bf16", "--rounds", "1"))


def test_the_against_source_is_the_revisions_file():
    head = subprocess.run(["git", "show", "HEAD:engine/kernels/decode/decode_native.cpp"], capture_output=True,
                          text=True, cwd=native_build.SOURCE.parent, timeout=60)
    if head.returncode != 0:
        pytest.skip(f"not a git checkout here: {head.stderr.strip()}")
    assert builds.source_at("HEAD") == head.stdout
    with pytest.raises(SystemExit, match="no decode_native.cpp at"):
        builds.source_at("no-such-revision")


def test_bad_requests_say_what_was_expected(tmp_path):
    parser = argparse.ArgumentParser()
    builds.add_arguments(parser)
    with pytest.raises(SystemExit, match="two or more builds"):
        builds.builds_from(parser.parse_args(["--library", "x.so"]), tmp_path)
    with pytest.raises(SystemExit, match="is not a file"):
        builds.builds_from(parser.parse_args(["--library", "x.so", "--source", "y.cpp"]), tmp_path)
    with pytest.raises(SystemExit, match="unknown kind 'fp4'"):
        builds.cases(parser.parse_args(["--kinds", "fp4", "--keys", "64"]))


@needs_native
def test_placement_lays_the_pools_pages_as_asked(tmp_path, monkeypatch):
    placed = []
    real = builds.pools
    monkeypatch.setattr(builds, "pools", lambda *a: placed.append(a[-1]) or real(*a))
    args = arguments(tmp_path, "--kinds", "bf16", "--placement", "interleaved")
    assert [name for name, _, _ in builds.cases(args)] == ["bf16 contiguous", "bf16 pages of 16, interleaved"]
    assert placed == ["interleaved"]
    with pytest.raises(SystemExit):
        arguments(tmp_path, "--placement", "random")
    args.pages = []
    with pytest.raises(SystemExit, match="give --pages too"):
        builds.main(args)


def test_a_vector_path_is_the_sources_build_with_its_flags_and_one_this_cpu_lacks_is_refused(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    builds.add_arguments(parser)
    compiled = []
    monkeypatch.setattr(native_build, "compiler", lambda: "c++")
    monkeypatch.setattr(native_build, "_build", lambda cxx, target, flags, source: compiled.append((flags, source)))
    monkeypatch.setattr(builds, "load_build", lambda label, path: builds.Build(label, None))
    made = builds.builds_from(parser.parse_args(["--path", "native", "--path", "plain", "--quiet"]), tmp_path)
    assert [b.label for b in made] == ["native path", "plain path"]
    assert compiled == [(native_build.FLAGS, native_build.SOURCE), (native_build.path_flags("plain"),
                                                                     native_build.SOURCE)]
    assert "-march=native" not in native_build.path_flags("plain") and "-mavx2" in native_build.path_flags("avx2")
    # --against REV with --path: the revision's source and the working tree's, each built for every path asked for
    monkeypatch.setattr(builds, "source_at", lambda revision: f"// {revision}'s source\n")
    compiled.clear()
    made = builds.builds_from(parser.parse_args(["--against", "abc1234", "--path", "plain", "--path", "native",
                                                 "--quiet"]), tmp_path)
    assert [b.label for b in made] == ["abc1234, plain path", "working tree, plain path", "abc1234, native path",
                                       "working tree, native path"]
    old = tmp_path / "against.cpp"
    assert old.read_text() == "// abc1234's source\n"
    assert compiled == [(native_build.path_flags("plain"), old), (native_build.path_flags("plain"),
                                                                  native_build.SOURCE),
                        (native_build.FLAGS, old), (native_build.FLAGS, native_build.SOURCE)]
    monkeypatch.setattr(native_build, "cpu_key", lambda: "x86_64 flags: sse2 avx2 fma f16c")
    with pytest.raises(SystemExit, match="--path avx512 needs avx512f, avx512bw, avx512dq, which this CPU lacks"):
        builds.builds_from(parser.parse_args(["--path", "avx512", "--path", "plain"]), tmp_path)
    with pytest.raises(SystemExit, match="--path neon needs asimd, which this CPU lacks"):  # (aarch64's)
        builds.builds_from(parser.parse_args(["--path", "neon", "--path", "plain"]), tmp_path)
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "sve"])


@needs_native
def test_group_sets_the_query_rows_a_kv_head(tmp_path, monkeypatch):
    # --group G: Hq = 8 G over Hkv 8, the same K/V bytes whatever G; each case's plan sees G rows a KV head
    shapes = []
    real = builds._contiguous
    monkeypatch.setattr(builds, "_contiguous", lambda q, k, v: shapes.append((q.shape[1], k.shape[1])) or real(q, k, v))
    for group in (4, 8):
        args = arguments(tmp_path, "--kinds", "int8", "--group", str(group), "--keys", "2k")
        args.pages = []
        (name, make, kv_bytes), = builds.cases(args)
        make()
        assert kv_bytes == 2 * 2 * builds.HKV * 2048 * (builds.D + 4)  # (int8 rows and their fp32 scales)
    assert shapes == [(32, 8), (64, 8)]
