"""The native kernel's portable C++ path (no AVX-512 or AVX2: the compiler's own vectors) against the float64 oracle
of tests/native/portable_check.cpp, which includes the kernel's source: every fp16 and e4m3 code as the kernel reads
it, then decodes over each kind, head dims no vector width divides, 1-6 rows, masks, 1 and 2 threads, contiguous and
over shuffled pages. Built for this machine without -march (x86-64's SSE2), and for aarch64 (NEON) run under qemu
where a cross compiler and qemu are installed (Debian: g++-aarch64-linux-gnu, qemu-user): there every code, and half
the decodes (each case's first and last variant), the emulator taking 53 s for all of them."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("native") / "portable_check.cpp"
FLAGS = ("-O3", "-std=c++17", "-pthread")
ARM_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"


def build_and_run(compiler: list[str], flags: tuple[str, ...], run: list[str], tmp_path: Path, *args: str) -> str:
    binary = tmp_path / "portable_check"
    built = subprocess.run([*compiler, *flags, str(CHECK), "-o", str(binary)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    done = subprocess.run([*run, str(binary), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cxx", ["g++", "clang++"])  # (clang fuses a * b + c itself: lane_fma's other branch)
def test_the_portable_path_built_for_this_cpu_without_march_matches_the_oracle(cxx, tmp_path):
    if platform.machine() != "x86_64" or shutil.which(cxx) is None:
        pytest.skip(f"needs {cxx} on x86-64")
    out = build_and_run([cxx], (*FLAGS, "-fopenmp-simd"), [], tmp_path)  # (its threads its own: no -fopenmp)
    assert "lanes 1; 540 cases" in out and out.rstrip().endswith("; 0 wrong")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(ARM_CXX) is None or shutil.which(QEMU) is None,
                    reason=f"needs {ARM_CXX} and {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user)")
def test_the_portable_path_built_for_aarch64_matches_the_oracle_under_qemu(tmp_path):
    sysroot = "/usr/aarch64-linux-gnu"
    out = build_and_run([ARM_CXX], (*FLAGS, "-march=armv8-a", "-fopenmp", "-Wno-psabi"), [QEMU, "-L", sysroot],
                        tmp_path, "quick")  # (half the decodes under the emulator; every code of fp16 and e4m3)
    assert "lanes 1; 270 cases" in out and out.rstrip().endswith("; 0 wrong")
