"""What every benchmark shares: median timings, peak memory, a progress bar, a table, JSON/CSV files.

Benchmarks are not tests: they print a table with the peer measured in the same run and save their
results under a folder the user picks.
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def median_ms(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1, max_seconds: float | None = None) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` runs after ``warmup`` runs.

    ``max_seconds`` stops repeating early once that much time has been spent (at least one timed run).
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        times.append(elapsed * 1e3)
        spent += elapsed
        if max_seconds is not None and spent >= max_seconds:
            break
    return statistics.median(times)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _load_mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _load_mallinfo2()


def heap_bytes() -> int:
    """Bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``); RSS where unavailable.

    torch's CPU tensors are allocated with malloc, so this follows tensor memory exactly, without being
    fooled by freed memory that the allocator keeps for reuse (which RSS still counts).
    """
    if _MALLINFO2 is None:
        return rss_bytes()
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


class CudaPeakMemory:
    """Context manager: the CUDA allocator's peak above its level at entry (exact: the allocator counts)."""

    def __enter__(self) -> CudaPeakMemory:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.baseline = torch.cuda.memory_allocated()
        self.peak = self.baseline
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak - self.baseline)


class PeakMemory:
    """Context manager: peak allocated memory above the level at entry, sampled every ``interval`` s.

    torch's CPU allocator keeps no statistics, so this samples the C heap's in-use bytes (``heap_bytes``)
    from a thread (torch releases the GIL inside its kernels). An allocation that lives shorter than the
    interval can be missed; attention's large buffers live for milliseconds.

        with PeakMemory() as peak:
            run()
        peak.extra_bytes
    """

    def __init__(self, interval: float = 0.0002) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, heap_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        self.baseline = self.peak = heap_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = max(self.peak, heap_bytes())
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak - self.baseline)


def progress(items: Iterable, desc: str, total: int | None = None, quiet: bool = False) -> Iterable:
    """A progress bar on stderr (hidden when ``quiet``), so long runs show where they are."""
    return tqdm(items, desc=desc, total=total, disable=quiet, leave=False, dynamic_ncols=True)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Plain-text table: one row per dict, numbers right-aligned with sensible precision."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if value != value:
                return "-"
            if abs(value) >= 100:
                return f"{value:,.0f}"
            return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
        return "-" if value is None else str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save_results(out_dir: str | Path, name: str, rows: Sequence[dict[str, Any]],
                 meta: dict[str, Any] | None = None) -> list[Path]:
    """Write ``name.json`` (rows plus meta) and ``name.csv`` under out_dir; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / f"{name}.json", out / f"{name}.csv"
    json_path.write_text(json.dumps({"meta": meta or {}, "rows": list(rows)}, indent=2, default=str))
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return [json_path, csv_path]


def machine_info() -> dict[str, Any]:
    """Facts a reader needs to interpret timings: torch version, threads, CPU count."""
    import platform

    import torch

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version()}


def peak_allocated_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes held by torch's CPU allocator during one call of ``fn()``, above the level before it.

    Exact accounting of every tensor allocation and free, read from the profiler's memory events, so unlike
    sampling (``PeakMemory``) it misses no short-lived allocation and is not hidden by memory that malloc keeps
    after a free. It counts tensor storage only (not the Python heap), including the tensor ``fn`` returns.
    """
    from torch.profiler import ProfilerActivity, profile

    with _silenced_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()  # positive for an allocation, negative for a free
        peak = max(peak, held)
    return peak


class _silenced_stderr:
    """Send file descriptor 2 to /dev/null for a moment: the profiler's C++ side logs every start and stop."""

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)


def interleaved_rounds(impls: dict[Any, Callable[[], Any]], rounds: int, calls: int, warmup: int = 20,
                       before: Callable[[], Any] | None = None) -> dict[Any, list[float]]:
    """Each implementation's mean microseconds per call in every round (lists indexed by round); a round runs each
    implementation ``calls`` times, in an order that rotates from round to round. ``before`` (untimed) runs before
    every timed call, each call then timed on its own: ``evict_caches`` for calls timed cold."""
    names = list(impls)
    for name in names:
        for _ in range(warmup):
            impls[name]()
    per_round: dict[Any, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            fn, seconds = impls[name], 0.0
            if before is None:
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                seconds = time.perf_counter() - start
            else:
                for _ in range(calls):
                    before()
                    start = time.perf_counter()
                    fn()
                    seconds += time.perf_counter() - start
            per_round[name].append(seconds / calls * 1e6)
    return per_round


def interleaved_us(impls: dict[str, Callable[[], Any]], rounds: int, calls: int, warmup: int = 20) -> dict[str, float]:
    """Median over rounds of each implementation's mean microseconds per call (``interleaved_rounds``)."""
    return {name: statistics.median(times) for name, times in interleaved_rounds(impls, rounds, calls, warmup).items()}


def paired_ratio(times: Sequence[float], base: Sequence[float]) -> float:
    """The median over rounds of ``times[i] / base[i]``: a ratio of two implementations timed in the same rounds.

    On a shared machine the speed drifts for seconds at a time (another tenant's memory traffic: 1.5-2x slower
    stretches were seen), so each implementation's median can fall in a different stretch; the ratio within a round
    does not (both ran within a fraction of a second), which makes the median of those ratios the steadier figure."""
    if len(times) != len(base) or not times:
        raise ValueError(f"paired_ratio needs two equal, non-empty lists of round times, got {len(times)} and "
                         f"{len(base)}")
    return statistics.median(t / b for t, b in zip(times, base))


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "48K", "2048K", "491520K"


def last_level_cache_bytes() -> int:
    """The size of CPU 0's largest cache as Linux reports it (sysfs), or 0 where it does not."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        sizes.append(int(text[:-1]) * _SIZE_UNITS[text[-1]] if text[-1:] in _SIZE_UNITS else int(text or 0))
    return max(sizes)


_EVICTION: list[Any] = []  # the buffer evict_caches writes (made on first use)


def evict_caches() -> None:
    """Read and write a buffer of twice the last-level cache (256 MiB to 512 MiB), so that a call timed after it
    reads its operands from memory, whatever the call before it touched. Without it, a case's row that followed a
    read of the same K/V found part of them still in the cache (an AMX Xeon VM reporting 480 MiB of L3: bf16 at B 1,
    S 32k, 134 MB, took 8.7 ms after such a read and 10.6 ms cold)."""
    import torch

    if not _EVICTION:
        size = min(max(2 * last_level_cache_bytes(), 256 << 20), 512 << 20)
        _EVICTION.append(torch.zeros(size // 4, dtype=torch.float32))
    _EVICTION[0].add_(1.0)  # (plain loads and stores: a fill could take non-temporal stores, which bypass caches)
