"""Option parsing every command shares: argparse types for counts and numbers, and the flags every bench
shares (``--quick``, ``--out``, ``--impl``, ``--repeats``, ``--seed``, ``--threads``, ``--quiet``).
"""

from __future__ import annotations

import argparse
import math

from lab.units import parse_bytes


def parse_count(text: str) -> int:
    """A count such as ``8192``, ``128k`` (x1024, as the seeds write contexts), ``8e9`` or ``70.6B`` (x1e9)."""
    suffixes = {"k": 1024, "m": 10**6, "b": 10**9}
    raw = str(text).strip().lower().replace("_", "").replace(",", "")
    scale = suffixes.get(raw[-1:], 1)
    number = raw[:-1] if scale != 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a positive whole count like 8192, 128k, 8e9 or 70.6B, "
                                         f"got {text!r}")
    return int(value)


def parse_counts(text: str) -> list[int]:
    """Comma-separated counts: ``"8192,32k,128k"`` -> ``[8192, 32768, 131072]``."""
    return [parse_count(part) for part in str(text).split(",") if part.strip()]


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, with a message that says what was given."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def byte_size(text: str) -> int:
    """argparse type: a size such as ``80GiB`` or ``16GB`` (see ``lab.units.parse_bytes``)."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_common(parser: argparse.ArgumentParser, name: str, impl_help: str | None = None, threads: int = 1) -> None:
    """Add the shared bench flags; results go to ``results/<name>`` unless ``--out`` says otherwise; ``threads``:
    the default of ``--threads``."""
    parser.add_argument("--quick", action="store_true", help="tiny sizes that finish in seconds (a smoke test)")
    parser.add_argument("--out", default=f"results/{name}",
                        help=f"folder for the JSON/CSV results and PNG plots (default results/{name})")
    parser.add_argument("--impl", default="all",
                        help=impl_help or "comma-separated implementations to run, or 'all' (default): every "
                        "engine kernel registered in engine.kernels.dispatch.KERNELS, and torch-sdpa")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per point; the median is reported (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default 0)")
    parser.add_argument("--threads", type=positive_int, default=threads,
                        help=f"torch intra-op threads (default {threads}" + (": on a shared machine a multi-threaded "
                        "op waits milliseconds for a descheduled worker, which swamps small timings)" if threads == 1
                        else ")"))
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's intra-op thread count from ``--threads`` (every timing in a run uses the same count)."""
    import torch

    torch.set_num_threads(args.threads)
