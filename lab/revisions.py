"""The native decode kernel's source (``decode_native.cpp``) at a git revision of this checkout: what ``run.py bench
builds --against REV`` and ``run.py bench arm --against REV`` build beside the working tree's."""

from __future__ import annotations

import subprocess

from engine.kernels.decode import native_build


def source_at(revision: str) -> str:
    """decode_native.cpp's text at ``revision`` (SystemExit, with git's words, where it has none)."""
    done = subprocess.run(["git", "show", f"{revision}:./{native_build.SOURCE.name}"], capture_output=True, text=True,
                          timeout=60, cwd=native_build.SOURCE.parent)  # (./: relative to the source's folder)
    if done.returncode != 0:
        raise SystemExit(f"no decode_native.cpp at {revision!r}: {done.stderr.strip()}")
    return done.stdout
