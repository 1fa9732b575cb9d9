"""`run.py attention`: every implementation reproduces the seeds' numbers; a wrong one is caught."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import examples
from engine.cli import main as cli_main
from engine.reference import lists

ROOT = Path(__file__).resolve().parents[1]
_dot_spread_once = functools.cache(lists.dot_spread)


@pytest.fixture(autouse=True)
def _same_dot_spread_for_every_implementation(monkeypatch):
    # lists.dot_spread (the demo's last section: 2,000 pure-Python random.Random(d_k) draws per d_k, ~1.3 s) calls no
    # attention implementation, so each --impl checks the same three numbers: computed for real once per session,
    # by the first test that needs them, and checked against the seeds' values by every test as before
    monkeypatch.setattr(lists, "dot_spread", _dot_spread_once)


@pytest.mark.parametrize("impl", sorted(examples.implementations()))
def test_every_implementation_reproduces_the_seeds(impl, capsys):
    assert cli_main(["attention", "--impl", impl]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert "25/25 results match the seeds' stated values" in out


def test_an_off_by_one_mask_fails_the_demo(capsys):
    good = examples.implementations()["loops"]

    def off_by_one(q, k, v, causal, scale, valid):  # query i also sees key i+1
        if not causal:
            return good(q, k, v, causal, scale, valid)
        from engine.attention import causal_attention

        qpos = torch.arange(k.shape[0] - q.shape[0], k.shape[0]) + 1
        return causal_attention(q[None, None], k[None, None], v[None, None], qpos, scale=scale)[0, 0].double()

    report = examples.run_examples(off_by_one)
    assert report.failures >= 6
    assert "FAIL" in capsys.readouterr().out


def test_run_py_exits_nonzero_on_unknown_command_and_lists_commands():
    proc = subprocess.run([sys.executable, "run.py", "nonsense"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "attention" in proc.stderr and "bench kernels" in proc.stderr
    proc = subprocess.run([sys.executable, "run.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "memory" in proc.stdout


def test_main_demo_runs_as_a_script():
    proc = subprocess.run([sys.executable, "run.py", "attention", "--impl", "engine"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "25/25 results match" in proc.stdout
