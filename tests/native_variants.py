"""The native kernel's other vector paths, built for tests/test_decode_native.py (its ``variant_library``).

The cached build is -march=native, the widest this CPU has (AVX-512 here, AVX2 on a Zen 3), so the narrower paths are
built here too and checked: a CPU without AVX-512 (or without AVX2, or not x86) runs code that was tested. Each is built
with native_build.path_flags(path, openmp=False) (no -march=native, no -fopenmp: its own threads), beside the engine's
cached library and named as native_build names its own (a digest of the source, the flags, the compiler and the CPU):
an edit of the source builds them again, the same source is not compiled again by every run.

The builds start once per session, one compiler at a time in the background, as soon as collection shows a test that
needs them (conftest.py), so that they overlap the tests before it instead of holding up the first that needs one."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from engine.kernels.decode import native_build

VARIANTS = {"avx512": ("avx512", 16), "avx2": ("avx2", 8), "plain_cpp": ("plain", 1)}  # (native_build's path, lanes)

_builds: dict[str, tuple[Path, Future | None]] = {}
_pool: list[ThreadPoolExecutor] = []


def missing(name: str) -> list[str]:
    """The CPU flags variant ``name`` needs that this CPU lacks (none: it runs here)."""
    return native_build.path_missing(VARIANTS[name][0])


def variant_path(cxx: str, name: str) -> Path:
    """Where variant ``name`` is built: native_build's own name for a build with its flags, the variant's name in it."""
    path = native_build.library_path(cxx, native_build.path_flags(VARIANTS[name][0], openmp=False))
    return path.with_name(path.name.replace("decode_native-", f"decode_native-{name}-", 1))


def start_builds() -> dict[str, tuple[Path, Future | None]]:
    """Each variant this CPU runs: its path and its build (None: already built), started on the first call."""
    if not _builds and native_build.native_unavailable() is None:
        cxx = native_build.compiler()
        pool = ThreadPoolExecutor(1, thread_name_prefix="variant-build")
        _pool.append(pool)
        for name, (vector_path, _) in VARIANTS.items():
            if not missing(name):
                path = variant_path(cxx, name)
                flags = native_build.path_flags(vector_path, openmp=False)
                _builds[name] = path, None if path.exists() else pool.submit(native_build._build, cxx, path, flags)
    return _builds


def finish() -> None:
    """Drops the builds not started yet and waits for the running one (each compile has native_build's timeout)."""
    for pool in _pool:
        pool.shutdown(wait=True, cancel_futures=True)
