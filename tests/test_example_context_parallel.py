"""examples/context_parallel.py runs under torchrun (2 processes, gloo, loopback) and plain python (a world of 1),
and its gathered output, lse and gradients equal one process's ``causal_attention`` on the whole sequence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "context_parallel.py"
# 303 tokens in 2P = 4 chunks of 76, 76, 76, 75: shards of 151 and 152 tokens (the gathers pad the shorter one);
# a window and documents, so the masks cross shards.
OPTIONS = ["--length", "303", "--window", "64", "--documents", "3", "--heads", "4", "--head-dim", "32"]
# float64 on both sides, exact in real arithmetic: the two differ by roundoff (the example's own tolerance is
# 8 eps sqrt(T) max(1, |reference|) ~ 1e-13 here); a wrong mask or a lost gradient share is O(0.1).
FLOAT64_ROUNDOFF = 1e-12


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def _max_difference(stdout: str) -> float:
    match = re.search(r"^max difference: (\S+) \((\w+)\), within tolerance: (\w+)$", stdout, flags=re.M)
    assert match, f"no 'max difference' line in:\n{stdout}"
    assert match.group(3) == "yes", stdout
    return float(match.group(1))


@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_two_ranks_under_torchrun_match_one_process(method):
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(EXAMPLE), *OPTIONS, "--method", method])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 ranks (gloo, cpu)" in proc.stdout
    assert _max_difference(proc.stdout) < FLOAT64_ROUNDOFF


def test_plain_python_is_a_world_of_one():
    proc = _run([sys.executable, str(EXAMPLE), *OPTIONS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 rank (gloo, cpu)" in proc.stdout
    assert _max_difference(proc.stdout) < FLOAT64_ROUNDOFF
