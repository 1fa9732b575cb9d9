"""The native decode library as Python holds it once loaded (engine.kernels.decode.native_build builds and finds it):
the one C struct a call passes (``DecodeCall``, field for field the source's, its offsets checked at load), the
library's entry points and what it reports of itself (``NativeLibrary``), and ``ATTENTION_ENGINE_BF16_DOT``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

BF16_DOT_ENV = "ATTENTION_ENGINE_BF16_DOT"  # 1 / 0 / auto (NativeLibrary.dot_mode)

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class DecodeCall(ctypes.Structure):
    """The one argument of the C entry point ``decode_native`` (``DecodeCall`` in decode_native.cpp, field for
    field; a library whose offsets differ is refused at load). Shapes and strides count elements."""

    _fields_ = [
        ("kind", _I64), ("threads", _I64),
        ("B", _I64), ("H", _I64), ("R", _I64), ("S", _I64), ("D", _I64), ("Dv", _I64),
        ("k", _PTR), ("k_strides", _I64 * 3), ("k_scale", _PTR), ("k_scale_strides", _I64 * 3),
        ("v", _PTR), ("v_strides", _I64 * 3), ("v_scale", _PTR), ("v_scale_strides", _I64 * 3),
        ("q", _PTR), ("q_strides", _I64 * 3), ("scale", ctypes.c_double),
        ("visible", _PTR), ("visible_strides", _I64 * 4),
        ("out", _PTR), ("lse", _PTR),
        ("pages", _PTR), ("pages_stride", _I64), ("page_size", _I64), ("lengths", _PTR), ("key_offset", _I64),
        ("io_kind", _I64),  # q's and out's: 0 fp32, 1 bf16 (decode_native.IO_KINDS)
        ("rows_alone", _I64),  # 1: each row as alone (batch-invariant mode): no AMX-BF16 tiles
        ("softcap", ctypes.c_double),  # > 0: scores capped, softcap * tanh(score / softcap); 0: none
        # ALiBi (engine.kernels.decode.native_scores): slopes fp32 [B|1, Hq] or null, query / key positions fp32
        ("alibi", _PTR), ("alibi_stride", _I64), ("queries", _I64), ("query_pos", _PTR), ("query_pos_stride", _I64),
        ("key_pos", _PTR), ("key_pos_stride", _I64),
        ("bias", _PTR), ("bias_strides", _I64 * 4),  # a bias fp32 [B, Hq, T, S] (element strides, 0: broadcast)
    ]


# decode_native's return codes
OK, UNKNOWN_KIND, NON_FINITE_Q = 0, 1, 2


class NativeLibrary:
    """The loaded library: ``decode(call)`` runs one ``DecodeCall``, ``listed_tables`` builds a list of keys' page
    table, ``lanes`` is its vector width (1: the portable C++), ``openmp`` whether its runs go to OpenMP's workers,
    ``amx`` whether it computes int8 K/V on AMX tiles (a CPU with AMX-INT8, granted by Linux), ``bf16_tiles``
    whether a bf16 q's calls of 16 or more rows a KV head run on AMX-BF16 tiles (``use_bf16_tiles`` turns them off),
    ``bf16_dot`` whether bf16 K's scores are AVX512-BF16 dot products where q's values are bf16 numbers (where
    ``dot_rates``, ns per vdpbf16ps and per FMA timed once as the library loads, show one costing at most
    ``dot_rates[2]`` FMAs; ``use_bf16_dot`` forces it, ``dot_mode`` says how it is set: None by the rates, else
    forced, at load by ``ATTENTION_ENGINE_BF16_DOT``), ``build_s`` the seconds the build took in this process (0 when
    the cache had it)."""

    def __init__(self, path: Path, build_s: float) -> None:
        self.path, self.build_s = path, build_s
        self.lib = ctypes.CDLL(str(path))
        self.lib.decode_native_layout.restype = ctypes.c_int
        self.lib.decode_native_layout.argtypes = [ctypes.POINTER(_I64), ctypes.c_int]
        offsets = (_I64 * 64)()
        count = self.lib.decode_native_layout(offsets, 64)
        ours = [getattr(DecodeCall, name).offset for name, _ in DecodeCall._fields_] + [ctypes.sizeof(DecodeCall)]
        if not layout_fits(list(offsets[:count]), ours):
            raise RuntimeError(f"{path} lays DecodeCall out as {list(offsets[:count])}, Python as {ours}: the "
                               f"library and engine/kernels/native_build.py disagree")
        self.decode = self.lib.decode_native
        self.decode.restype = ctypes.c_int
        self.decode.argtypes = [ctypes.POINTER(DecodeCall)]
        self.lib.decode_native_lanes.restype = ctypes.c_int
        self.lanes = int(self.lib.decode_native_lanes())
        # whether it reads DecodeCall.softcap (a library built from an older source, as run.py bench builds times,
        # would ignore the field: a capped call is not given to it)
        self.softcap = hasattr(self.lib, "decode_native_softcap") and bool(self.lib.decode_native_softcap())
        self.alibi = hasattr(self.lib, "decode_native_alibi") and bool(self.lib.decode_native_alibi())
        self.bias = hasattr(self.lib, "decode_native_bias") and bool(self.lib.decode_native_bias())
        # the runs on OpenMP's workers (torch's), or on the library's own threads (NO_OPENMP_FLAGS)
        self.openmp = not hasattr(self.lib, "decode_native_openmp") or bool(self.lib.decode_native_openmp())
        self.lib.decode_native_amx.restype = ctypes.c_int
        self.amx = bool(self.lib.decode_native_amx())  # int8 K/V on AMX tiles where they fit (amx_usable)
        # many rows a KV head on AMX-BF16 tiles (a library built from an older source has no such path)
        tiles = getattr(self.lib, "decode_native_bf16_tiles", None)
        self.bf16_tiles = bool(tiles()) if tiles is not None else False
        self.lib.decode_native_bf16_dot.restype = ctypes.c_int
        self.bf16_dot = bool(self.lib.decode_native_bf16_dot())  # bf16 K against bf16 numbers in q: vdpbf16ps
        # (a library built from an older source, which run.py bench builds may time, has neither of the two below)
        timed, rates = hasattr(self.lib, "decode_native_bf16_dot_rates"), (ctypes.c_double * 3)()
        self.dot_rates = tuple(rates) if timed and self.lib.decode_native_bf16_dot_rates(rates) else None
        self.dot_mode: bool | None = None
        if timed:
            self.lib.decode_native_use_bf16_dot.restype = ctypes.c_int
            self.lib.decode_native_use_bf16_dot.argtypes = [ctypes.c_int]
            # (the mode is the loaded file's: objects loading one path share it, so only an asked mode is applied)
            if (asked := dot_mode_asked()) is not None:
                self.use_bf16_dot(asked)
        self.listed_tables = self.lib.decode_native_listed_tables  # (engine.kernels.decode.native_listed)
        self.listed_tables.restype = ctypes.c_int
        self.listed_tables.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, ctypes.c_int, _PTR, _I64,
                                       _PTR, _I64, _I64, _I64]

    def use_bf16_tiles(self, on: bool) -> bool:
        """Turn this process's later calls' bf16 AMX tiles off (False) or back on (True, where the build has them);
        for tests and A/B timings. Returns ``bf16_tiles`` after."""
        if hasattr(self.lib, "decode_native_use_bf16_tiles"):
            self.bf16_tiles = bool(self.lib.decode_native_use_bf16_tiles(int(on)))
        return self.bf16_tiles

    def use_bf16_dot(self, mode: bool | None) -> bool:
        """Force this process's later calls onto vdpbf16ps scores (True, where the build has them) or the FMAs
        (False), or leave it to ``dot_rates`` (None); for tests and A/B timings. Returns ``bf16_dot`` after."""
        self.bf16_dot = bool(self.lib.decode_native_use_bf16_dot(-1 if mode is None else int(mode)))
        self.dot_mode = mode
        return self.bf16_dot


def layout_fits(theirs: list[int], ours: list[int]) -> bool:
    """Whether a library whose ``decode_native_layout`` gave ``theirs`` (each field's offset, then the struct's size)
    reads Python's ``DecodeCall`` (``ours``, alike): the same layout, or an older source's whose fields are the first
    of ours and end where our next one starts (it reads those and ignores the rest: run.py bench builds times older
    sources this way)."""
    if theirs == ours:
        return True
    fields = len(theirs) - 1
    return 0 < fields < len(ours) - 1 and theirs[:fields] == ours[:fields] and theirs[fields] == ours[fields]


def dot_mode_asked() -> bool | None:
    """``ATTENTION_ENGINE_BF16_DOT``: True (``1``), False (``0``) or None (unset, empty or ``auto``); any other value
    is refused (the library does not load, and explain() says why)."""
    value = os.environ.get(BF16_DOT_ENV, "").strip().lower()
    if value not in ("", "auto", "0", "1"):
        raise RuntimeError(f"{BF16_DOT_ENV}={os.environ[BF16_DOT_ENV]!r}: expected 1 (pair dot products), 0 (FMAs) "
                           f"or auto")
    return None if value in ("", "auto") else value == "1"
