"""The native kernel's portable C++ path (no AVX-512 or AVX2: the compiler's own vectors) and its NEON path against the
float64 oracle of tests/native/portable_check.cpp, which includes the kernel's source: every fp16 and e4m3 code as the
kernel reads it, then decodes over each kind, head dims no vector width divides, 1-6 rows, masks, 1 and 2 threads,
contiguous and over shuffled pages, NaN / inf keys and fp8 NaN codes, and batch invariance (bitwise). Built for this
machine without -march (x86-64's SSE2), and for aarch64 run under qemu where a cross compiler and qemu are installed
(Debian: g++-aarch64-linux-gnu, qemu-user): its NEON path and (DN_PORTABLE) its portable one side by side, each with
every code and half the decodes (each case's first and last variant), the emulator taking 12-14 s for each."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("native") / "portable_check.cpp"
FLAGS = ("-O3", "-std=c++17", "-pthread")
ARM_CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"


def build_and_run(compiler: str, flags: tuple[str, ...], tmp_path: Path) -> str:
    binary = tmp_path / "portable_check"
    built = subprocess.run([compiler, *flags, str(CHECK), "-o", str(binary)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("cxx", ["g++", "clang++"])  # (clang fuses a * b + c itself: lane_fma's other branch)
def test_the_portable_path_built_for_this_cpu_without_march_matches_the_oracle(cxx, tmp_path):
    if platform.machine() != "x86_64" or shutil.which(cxx) is None:
        pytest.skip(f"needs {cxx} on x86-64")
    out = build_and_run(cxx, (*FLAGS, "-fopenmp-simd"), tmp_path)  # (its threads its own: no -fopenmp)
    assert "lanes 1; 540 cases" in out and out.rstrip().endswith("; 0 wrong")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(ARM_CXX) is None or shutil.which(QEMU) is None,
                    reason=f"needs {ARM_CXX} and {QEMU} (Debian: g++-aarch64-linux-gnu, qemu-user)")
def test_the_neon_and_portable_paths_built_for_aarch64_match_the_oracle_under_qemu(tmp_path):
    flags = (*FLAGS, "-march=armv8-a", "-fopenmp", "-Wno-psabi")
    builds = {"neon": (), "portable": ("-DDN_PORTABLE",)}  # (built and run side by side: two processes each time)
    binaries = {name: tmp_path / f"check_{name}" for name in builds}
    done = run_together({name: [ARM_CXX, *flags, *extra, str(CHECK), "-o", str(binaries[name])]
                         for name, extra in builds.items()})
    for name, (code, out) in done.items():
        assert code == 0, f"{name} build: {out[-2000:]}"
    sysroot = "/usr/aarch64-linux-gnu"  # (half the decodes under the emulator; every code of fp16 and e4m3)
    done = run_together({name: [QEMU, "-L", sysroot, str(binary), "quick"] for name, binary in binaries.items()})
    for name, lanes in (("neon", 4), ("portable", 1)):
        code, out = done[name]
        assert code == 0 and f"lanes {lanes}; 270 cases" in out and out.rstrip().endswith("; 0 wrong"), out[-3000:]


def run_together(commands: dict[str, list[str]], timeout: float = 300) -> dict[str, tuple[int, str]]:
    """Each command in its own process group, all at once; each one's exit code and output (stdout, then stderr). One
    still running after `timeout` seconds is killed, its group with it, and fails the test."""
    started = {name: subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True) for name, command in commands.items()}
    results = {}
    try:
        for name, process in started.items():
            out, _ = process.communicate(timeout=timeout)
            results[name] = (process.returncode, out)
    finally:
        for process in started.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
    return results
