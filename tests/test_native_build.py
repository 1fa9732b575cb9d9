"""engine.kernels.decode.native_build: where the compiler refuses -fopenmp (clang without libomp, as Apple's), the
library is built without it and found so next time; where neither build works, the error gives both compilers'
words. The compiler here is a script standing in for one (no compile: it copies the library this machine has)."""

from __future__ import annotations

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
