"""Byte sizes, read and written exactly: decimal units (GB = 1e9 bytes) and binary units (GiB = 2**30 bytes).

The seeds use both, and mixing them hides a 7% error: 16 GiB = 17.2 GB. Every figure of the lab says
which one it uses.

    parse_bytes("80GiB")  -> 85_899_345_920
    parse_bytes("80 GB")  -> 80_000_000_000
    format_bytes(2**28, "MiB") -> "256 MiB"
"""

from __future__ import annotations

import math
import re

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_BY_LOWER = {name.lower(): name for name in UNITS}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def parse_bytes(text: str) -> int:
    """Parse a size such as ``"80GiB"``, ``"34.4 GB"``, ``"512MiB"`` or ``"1000"`` (bytes) into bytes.

    Units are case-insensitive; ``GB`` is 1e9 and ``GiB`` is 2**30. Raises ValueError on anything else.
    """
    match = _SIZE.match(str(text))
    unit = _BY_LOWER.get(match.group(2).lower() or "b") if match else None
    if match is None or unit is None:
        raise ValueError(f"expected a size like '80GiB', '16GB' or '512MiB' (units: {', '.join(UNITS)}), "
                         f"got {text!r}")
    value = float(match.group(1)) * UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a size must be positive and finite, got {text!r}")
    return round(value)


def format_bytes(n: float, unit: str | None = None, digits: int | None = None) -> str:
    """Format ``n`` bytes in ``unit`` (default: the largest binary unit that keeps the value >= 1).

    ``digits`` fixes the decimals; by default whole values print without decimals, others with 3 significant.
    """
    if unit is None:
        unit = next((u for u in ("TiB", "GiB", "MiB", "KiB") if abs(n) >= UNITS[u]), "B")
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    value = n / UNITS[unit]
    if digits is not None:
        return f"{value:,.{digits}f} {unit}"
    if value == int(value):
        return f"{int(value):,} {unit}"
    return f"{value:,.3g} {unit}" if abs(value) < 100 else f"{value:,.1f} {unit}"


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``fp32``, ``fp16``, ``bf16``, ``fp8``)."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[name]


def _meminfo(field: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return 0


def machine_memory_bytes() -> int:
    """Total physical memory of this machine (``MemTotal`` of /proc/meminfo), or 0 where unknown."""
    return _meminfo("MemTotal")


def available_memory_bytes() -> int:
    """Memory a new allocation could get now (``MemAvailable`` of /proc/meminfo), or 0 where unknown."""
    return _meminfo("MemAvailable")
