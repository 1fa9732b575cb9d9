"""engine.kernels.decode.native_build: where the compiler refuses -fopenmp (clang without libomp, as Apple's), the
library is built without it and found so next time; where neither build works, the error gives both compilers'
words. The compiler here is a script standing in for one (no compile: it copies the library this machine has)."""

from __future__ import annotations

import ctypes
import os
import stat

import pytest

from engine.kernels.decode import native_build
from engine.kernels.decode.native_build import FLAGS, NO_OPENMP_FLAGS, built_library, library_path
from tests.test_decode_native import NATIVE, load_native


def fake_compiler(tmp_path, refuse: str) -> str:
    """A compiler that logs each build's flags, refuses those holding ``refuse`` (any: "") and else copies the
    loaded library to its -o target."""
    script = tmp_path / "cxx"
    library = load_native().path if NATIVE else "/nonexistent"
    script.write_text(f"""#!/bin/sh
case "$*" in *--version*) echo "fake cxx 1.0"; exit 0;; esac
echo "$*" >> {tmp_path}/builds.log
case " $* " in *" {refuse} "*) echo "unsupported option '{refuse}'" >&2; exit 1;; esac
while [ "$#" -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
cp {library} "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def builds(tmp_path) -> list[str]:
    log = tmp_path / "builds.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(not NATIVE, reason="no native library here to stand in for a build")
def test_a_compiler_refusing_openmp_builds_without_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_ENGINE_CACHE", str(tmp_path / "cache"))
    cxx = fake_compiler(tmp_path, "-fopenmp")
    path, seconds = built_library(cxx)
    assert path == library_path(cxx, NO_OPENMP_FLAGS) != library_path(cxx, FLAGS) and path.exists() and seconds > 0
    assert [("-fopenmp" in line.split(), "-fopenmp-simd" in line.split()) for line in builds(tmp_path)] == [
        (True, False), (False, True)]  # refused with OpenMP, then built without it (its simd loops kept)
    assert built_library(cxx) == (path, 0.0) and len(builds(tmp_path)) == 2  # found: no second refusal
    assert native_build.NativeLibrary(path, 0.0).lanes == load_native().lanes


def test_a_compiler_refusing_both_builds_names_both_refusals(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_ENGINE_CACHE", str(tmp_path / "cache"))
    cxx = fake_compiler(tmp_path, "-O3")
    with pytest.raises(RuntimeError, match="with OpenMP: .*unsupported option '-O3'.*; without: .*unsupported"):
        built_library(cxx)
    assert len(builds(tmp_path)) == 2 and not os.listdir(tmp_path / "cache")  # (no half-written library left)


def test_a_compiler_taking_openmp_builds_with_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTENTION_ENGINE_CACHE", str(tmp_path / "cache"))
    cxx = fake_compiler(tmp_path, "-no-such-flag")
    if not NATIVE:
        pytest.skip("no native library here to stand in for a build")
    path, _ = built_library(cxx)
    assert path == library_path(cxx, FLAGS) and len(builds(tmp_path)) == 1


@pytest.fixture
def fresh_cpu_lanes():
    """cpu_lanes read again from this CPU after the test, whatever it faked (it is cached)."""
    yield
    native_build.cpu_lanes.cache_clear()


def test_explain_names_the_vector_path_a_call_takes(monkeypatch, fresh_cpu_lanes):
    from types import SimpleNamespace

    from engine.kernels.decode.native_build import vector_path

    def cpu(machine: str, flags: str) -> None:
        monkeypatch.setattr(native_build.platform, "machine", lambda: machine)
        monkeypatch.setattr(native_build, "cpu_key", lambda: f"{machine} flags: {flags}")
        native_build.cpu_lanes.cache_clear()

    monkeypatch.setattr(native_build, "loaded_native", lambda: None)
    cpu("x86_64", "avx2 fma f16c avx512f avx512bw avx512dq")
    assert vector_path(128, 64) == "AVX-512 vectors (16 lanes)"
    assert vector_path(72, 64) == ("the portable C++ path (its loops the compiler's own vectors): D 72 / Dv 64 not "
                                   "both multiples of AVX-512's 16 lanes (slower than AVX-512)")
    assert vector_path(128, 40).startswith("the portable C++ path")  # (Dv counts too)
    cpu("x86_64", "avx2 fma f16c")
    assert vector_path(72, 40) == "AVX2 vectors (8 lanes)" and "AVX2's 8 lanes" in vector_path(36, 40)
    monkeypatch.setattr(native_build, "loaded_native", lambda: SimpleNamespace(lanes=16))  # the loaded build decides
    assert vector_path(128, 128) == "AVX-512 vectors (16 lanes)"
    monkeypatch.setattr(native_build, "loaded_native", lambda: None)
    cpu("aarch64", "fp asimd avx512f avx512bw avx512dq")  # (not x86: whatever its flags say)
    assert vector_path(128, 128) == "NEON vectors (4 lanes)" and vector_path(72, 40) == "NEON vectors (4 lanes)"
    assert vector_path(36, 64).endswith("D 36 / Dv 64 not both multiples of 8 (NEON's 4 lanes, two at a time) "
                                        "(slower than NEON)")  # (4 lanes, but read 8 values a step)
    cpu("x86_64", "sse2 fma f16c")
    assert vector_path(128, 128).endswith("no AVX-512, AVX2 or NEON here")


@pytest.mark.skipif(not NATIVE, reason="native kernel unavailable")
def test_explain_says_a_head_dim_no_vector_width_divides_takes_the_portable_path():
    import torch

    import engine

    wide = load_native().lanes
    if wide == 1:
        pytest.skip("this CPU's build is the portable path for every head dim")
    odd = wide + 4  # (a multiple of 4, not of the lanes)
    for d, portable in ((odd, True), (2 * wide, False)):
        told = str(engine.explain(torch.randn(1, 8, 1, d), torch.randn(1, 2, 300, d), torch.randn(1, 2, 300, d)))
        assert "decode_native" in told and ("portable C++ path" in told) == portable, told


def test_a_library_from_an_older_source_fits_where_its_fields_are_the_first_of_ours():
    from engine.kernels.decode.native_library import DecodeCall, layout_fits

    ours = [getattr(DecodeCall, name).offset for name, _ in DecodeCall._fields_] + [ctypes.sizeof(DecodeCall)]
    assert layout_fits(ours, ours)
    older = ours[:-2] + [ours[-2]]  # without our last field (rows_alone): its size is where that field starts
    assert layout_fits(older, ours)
    assert not layout_fits(ours[:-2] + [ours[-2] + 8], ours)  # a size past our next field: not a prefix
    assert not layout_fits(older[:3] + [older[3] + 8] + older[4:], ours)  # a field moved
    assert not layout_fits(ours + [ours[-1] + 8], ours)  # a newer library's (more fields than ours)
    assert not layout_fits([ours[-1]], ours)  # no fields at all
