"""Every registered command imports and answers --help; the public API reads as a list."""

from __future__ import annotations

import pytest

import engine
from engine.cli import COMMANDS, main


@pytest.mark.parametrize("words", [words for words, _, _ in COMMANDS], ids=" ".join)
def test_every_command_has_help(words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: run.py {' '.join(words)}")


def test_every_exported_name_exists():
    missing = [name for name in engine.__all__ if not hasattr(engine, name)]
    assert missing == []
    assert {"causal_attention", "explain", "merge_attention_states", "MultiHeadAttention", "KVCache"} <= set(
        engine.__all__)
