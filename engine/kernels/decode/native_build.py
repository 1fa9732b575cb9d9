"""Build and load the engine's native CPU code: one C++ file, compiled on first use, cached per CPU.

The source (``decode_native.cpp``) needs only the C++ standard library and the compiler's intrinsics headers,
so a build takes seconds, not the minute ``torch/extension.h`` costs. It is compiled with ``-march=native``:
the build uses the widest vectors this CPU has (AVX-512, else AVX2 + FMA + F16C, else the portable C++ whose
``omp simd`` loops the compiler makes its own vectors: SSE2's, NEON's), so the
cached library is keyed on the CPU (model and feature flags), the compiler, the flags and the source, and a
library is never loaded on a CPU it was not built for::

    ~/.cache/attention-engine/decode_native-<sha256(source, flags, compiler, cpu)[:16]>.so

``ATTENTION_ENGINE_NATIVE=0`` turns native code off (the pure-torch kernels run; explain() says why);
``ATTENTION_ENGINE_CACHE`` moves the cache; ``CXX`` names the compiler (default ``g++``);
``ATTENTION_ENGINE_BF16_DOT=1`` / ``0`` fixes how a bf16 q's scores are summed where the CPU has AVX512-BF16 (pair
dot products / FMAs), so that runs agree bitwise however the load's timing falls; unset or ``auto``, the rates timed
at load decide. Nothing is built while
choosing a kernel or explaining a call: the first call that runs the kernel builds it (seconds, once per CPU), or
``python run.py build-native`` does ahead of time.

The boundary with Python is one C struct, ``DecodeCall`` (declared in engine.kernels.decode.native_library and in
the source; the library reports its field offsets and a mismatch is refused at load).

OpenMP: the library is built with ``-fopenmp`` and links ``libgomp.so.1``, the runtime of PyPI's torch builds,
so the kernel's runs go to the OpenMP workers torch already has (no second thread pool). Where torch uses
another runtime (Intel's ``libiomp5`` or LLVM's ``libomp``: ``torch.__config__.parallel_info()`` names it), the
process holds two: results are the same, but the kernel's threads are not torch's and may share cores with
them; if that runtime refuses a second one in the process, set ``ATTENTION_ENGINE_NATIVE=0``. A compiler that
refuses ``-fopenmp`` (clang without libomp, as Apple's) builds the library without it (``NO_OPENMP_FLAGS``): its
runs then go to threads of its own.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from engine.kernels.decode.native_library import BF16_DOT_ENV, NativeLibrary, dot_mode_asked

SOURCE = Path(__file__).with_name("decode_native.cpp")
# -fopenmp: the kernel's threads are torch's OpenMP workers (the libgomp.so.1 torch has loaded serves this library too)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp")
# The other vector paths, built on this CPU for the tests and for ``run.py bench builds``: each path's flags in place
# of -march=native (the cached build takes the widest this CPU has; a CPU without AVX-512, or without AVX2, runs one
# of the others; an aarch64 one NEON's), and the CPU flags it needs. The plain path is the kernel's portable C++
# (DN_PORTABLE: its ``omp simd`` loops made vectors by the compiler, SSE2's on x86-64, NEON's on Arm).
VECTOR_PATHS = {
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"), ("avx512f", "avx512bw",
                                                                                          "avx512dq")),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "neon": ((), ("asimd",)),  # (every aarch64 CPU: its compilers' default target)
    "plain": (("-DDN_PORTABLE",), ()),
}
LANES = {16: ("AVX-512", 16), 8: ("AVX2", 8), 4: ("NEON", 8)}  # each build's lanes: its name, D's and Dv's multiple
DISABLE_ENV = "ATTENTION_ENGINE_NATIVE"
# A compiler without OpenMP's runtime (clang without libomp, Apple's among them) refuses -fopenmp: the library is then
# built without it, its runs on threads of its own (std::thread) and its `omp simd` loops still the compiler's vectors
NO_OPENMP_FLAGS = tuple(flag for flag in FLAGS if flag != "-fopenmp") + ("-fopenmp-simd",)
BUILD_TIMEOUT_S = 300


def cpu_key() -> str:
    """What the build depends on in this CPU: its model name and feature flags (``/proc/cpuinfo``)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    seen = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip() in wanted and name.strip() not in seen:
            seen[name.strip()] = value.strip()
    return f"{platform.machine()} " + " | ".join(f"{k}: {v}" for k, v in sorted(seen.items()))


@functools.cache
def native_amx() -> bool:
    """Whether the library computes int8 K/V on AMX tiles here (builds nothing; ``NativeLibrary.amx`` tells once it
    is loaded): the CPU has AMX-INT8 (the ``-march=native`` build compiles that path) and Linux grants a process the
    tiles, asked as the library asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA)."""
    flags = cpu_key().split()
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not {"amx_tile", "amx_int8"} <= set(flags):
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    return syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64


def native_bf16_tiles() -> bool:
    """Whether the library computes a bf16 q's calls of 16 or more rows a KV head (bf16, int8 or fp8 K/V; bf16 K/V's
    scores from 8 rows) on AMX-BF16 tiles here (builds nothing): the loaded library's ``bf16_tiles``, else whether the
    CPU has AMX-BF16 and AVX512-BF16 beside ``native_amx``'s AMX-INT8 and grant (what the ``-march=native`` build
    needs for that path)."""
    library = loaded_native()
    if library is not None:
        return library.bf16_tiles
    return native_amx() and {"amx_bf16", "avx512_bf16"} <= set(cpu_key().split())


def native_bf16_dot() -> bool | None:
    """Whether the library computes bf16 K's scores as AVX512-BF16 pair dot products (decode_native.cpp,
    DN_BF16_DOT; builds and loads nothing): False without AVX-512 and AVX512-BF16 (the ``-march=native`` build has no
    such path); where it has one, ``NativeLibrary.bf16_dot`` once this process has loaded the library (it times
    vdpbf16ps against an FMA as it loads), else None: not known yet."""
    if not bf16_dot_built():
        return False
    library = loaded_native()
    return None if library is None else library.bf16_dot


_loaded: list[NativeLibrary] = []  # (load_native's, once loaded)


def loaded_native() -> NativeLibrary | None:
    """The library if this process has loaded it already (``load_native``), else None; builds and loads nothing."""
    return _loaded[0] if _loaded else None


def bf16_dot_scores() -> str:
    """explain()'s words for how the library sums the scores of a bf16 q whose rows fit the AVX512-BF16 path
    (``bf16_dot_built``), and why (builds and loads nothing: ``native_bf16_dot``)."""
    if not bf16_dot_built():
        return "by FMAs (no AVX512-BF16 here)"
    library = loaded_native()
    if library is None:
        return ("as AVX512-BF16 pair dot products (vdpbf16ps) where one costs about an FMA's time, else by FMAs (the "
                "library times both as it loads)")
    dot, rates = library.bf16_dot, library.dot_rates
    if rates is None:
        return "by FMAs (this build has no AVX512-BF16 path: the compiler did not enable it)"
    dot_ns, fma_ns, most = rates
    timed = f"vdpbf16ps {dot_ns:.2f} ns, an FMA {fma_ns:.2f} ns here: {dot_ns / fma_ns:.2f}x, {most:g}x at most pays"
    if library.dot_mode is not None:
        timed += f"; forced ({BF16_DOT_ENV} or use_bf16_dot)"
    if dot:
        return f"as AVX512-BF16 pair dot products (vdpbf16ps; products exact, the scale applied to each sum; {timed})"
    return f"by FMAs, as an fp32 q's ({timed})"


@functools.cache
def bf16_dot_built() -> bool:
    """Whether the ``-march=native`` build has the AVX512-BF16 scores' path: an x86-64 CPU with AVX-512 and
    AVX512-BF16 (builds nothing)."""
    flags = set(cpu_key().split())
    return platform.machine() == "x86_64" and {"avx512f", "avx512bw", "avx512dq", "avx512_bf16"} <= flags


@functools.cache
def f8_words_built() -> bool:
    """Whether the ``-march=native`` build reads fp8 e4m3 as bf16 words by AVX512-VBMI byte lookups (decode_native.cpp,
    DN_F8_WORDS: ``bf16_dot_built`` and AVX512-VBMI), which the score tiles take for fp8 K/V of 4-15 rows a KV head
    (builds nothing)."""
    return bf16_dot_built() and "avx512vbmi" in set(cpu_key().split())


@functools.cache
def cpu_lanes() -> int:
    """The vector width the ``-march=native`` build has on this CPU (builds nothing): 16 (AVX-512), 8 (AVX2 + FMA +
    F16C), 4 (aarch64's NEON) or 1 (the portable C++: any other CPU)."""
    x86, arm = platform.machine() in ("x86_64", "AMD64"), platform.machine() in ("aarch64", "arm64")
    return 4 if arm else 16 if x86 and not path_missing("avx512") else 8 if x86 and not path_missing("avx2") else 1


def vector_path(d: int, dv: int) -> str:
    """explain()'s words for which of the library's paths reads head dims ``d`` / ``dv`` here (builds nothing: the
    loaded library's width, else the one this CPU's flags give the build)."""
    library = loaded_native()
    lanes = library.lanes if library is not None else cpu_lanes()
    portable = "the portable C++ path (its loops the compiler's own vectors)"
    if lanes not in LANES:
        return f"{portable}: no AVX-512, AVX2 or NEON here"
    name, multiple = LANES[lanes]
    if d % multiple or dv % multiple:  # (NEON: multiples of 8, "8 (NEON's 4 lanes, two at a time)")
        what = f"{name}'s {lanes} lanes" if multiple == lanes else f"{multiple} ({name}'s {lanes} lanes, two at a time)"
        return f"{portable}: D {d} / Dv {dv} not both multiples of {what} (slower than {name})"
    return f"{name} vectors ({lanes} lanes)"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def library_path(cxx: str, flags: tuple[str, ...] = FLAGS) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), version.encode(), cpu_key().encode()):
        digest.update(part)
    root = Path(os.environ.get("ATTENTION_ENGINE_CACHE") or Path.home() / ".cache" / "attention-engine")
    return root / f"decode_native-{digest.hexdigest()[:16]}.so"


@functools.cache
def native_unavailable() -> str | None:
    """Why this machine cannot build the native library (None: it can). Builds nothing: dispatch and explain()
    ask this; the library is built by the first call that runs it (``load_native``) or ahead of time by
    ``python run.py build-native``."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"native code is turned off ({DISABLE_ENV}=0)"
    try:
        dot_mode_asked()
    except RuntimeError as refused:  # (a library would not load: dispatch and explain() say so up front)
        return str(refused)
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return f"no native build for this CPU architecture ({platform.machine()})"
    if compiler() is None:
        return f"no C++ compiler found ({os.environ.get('CXX', 'g++')}): the native kernel cannot be built"
    return None


@functools.cache
def load_native() -> NativeLibrary | str:
    """The native library, built if this CPU has no cached build yet; or a string saying why it is unavailable."""
    why_not = native_unavailable()
    if why_not is not None:
        return why_not
    cxx = compiler()
    try:
        path, build_s = built_library(cxx)
        library = NativeLibrary(path, build_s)
        _loaded[:] = [library]
        return library
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        return f"the native kernel failed to build or load: {str(error).strip()[-300:]}"


def built_library(cxx: str) -> tuple[Path, float]:
    """The library for this CPU and ``cxx`` and the seconds its build took here (0: cached): built with ``FLAGS``, or
    where the compiler refuses them, with ``NO_OPENMP_FLAGS`` (found first if cached, so a refusal is met once). Raises
    RuntimeError with both compilers' words when neither builds."""
    paths = [library_path(cxx, flags) for flags in (FLAGS, NO_OPENMP_FLAGS)]
    for path in paths:
        if path.exists():
            return path, 0.0
    start = time.perf_counter()
    try:
        _build(cxx, paths[0])
        return paths[0], time.perf_counter() - start
    except RuntimeError as refused:
        try:
            _build(cxx, paths[1], NO_OPENMP_FLAGS)
        except RuntimeError as again:
            raise RuntimeError(f"with OpenMP: {str(refused).strip()[-200:]}; without: {again}") from None
        return paths[1], time.perf_counter() - start


def _build(cxx: str, path: Path, flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> None:
    """Compile into a temporary file beside ``path`` and move it in place (concurrent builds never see half a file).
    ``flags`` other than this CPU's (e.g. AVX2 only, or none: plain C++) build the other paths, for the tests;
    ``source`` another version of the kernel (``run.py bench builds``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def path_flags(path: str, openmp: bool = True) -> tuple[str, ...]:
    """The build flags of vector path ``path`` (``VECTOR_PATHS``): ``FLAGS`` (``NO_OPENMP_FLAGS`` without
    ``openmp``) with its flags for ``-march=native``."""
    return tuple(flag for flag in (FLAGS if openmp else NO_OPENMP_FLAGS) if flag != "-march=native") + \
        VECTOR_PATHS[path][0]


def path_missing(path: str) -> list[str]:
    """The CPU flags vector path ``path`` needs that this CPU lacks (``cpu_key``'s names; none: it can run it)."""
    flags = set(cpu_key().split())
    return [flag for flag in VECTOR_PATHS[path][1] if flag not in flags]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Compile the native decode kernel for this CPU now (else the first decode call that runs "
                          "it does, once per CPU) and print where the library is cached.")


def main(args: argparse.Namespace) -> int:
    """``run.py build-native``: build (or find) the library; 0 when it loads, 1 with the reason when it cannot."""
    library = load_native()
    if isinstance(library, str):
        print(f"the native kernel is unavailable: {library}")
        return 1
    built = f"built in {library.build_s:.1f} s" if library.build_s else "already built"
    vectors = f"{library.lanes}-lane vectors" if library.lanes > 1 else "the portable C++ (the compiler's vectors)"
    threads = "" if library.openmp else "; its own threads (the compiler has no OpenMP)"
    print(f"{library.path}: {built}, {vectors}{threads}")
    return 0
