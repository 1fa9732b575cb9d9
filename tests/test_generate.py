"""``run.py generate``: the tiny engine decoder end to end (chunked prefill, cached decode, memory figures)."""

import argparse
import re

import pytest
import torch

from engine import cli
from engine.generate import TinyDecoder, add_arguments, check_against_full_forward, generate, left_padded_prompts
from engine.kv_cache import kv_cache_bytes

SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--batch", "2",
         "--prompt-len", "12", "--new-tokens", "20", "--no-progress"]


def run(capsys, *extra) -> tuple[int, str, str]:
    code = cli.main(["generate", *SMALL, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_default_run_reports_speed_memory_and_passes_its_check(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert re.search(r"prefill: 24 tokens in [\d.]+ ms = [\d,]+ tokens/s", out)
    assert re.search(r"decode:  38 tokens in [\d.]+ ms = [\d,]+ tokens/s", out)  # 2 rows x 19 decode steps
    expected = kv_cache_bytes(2, 2, 2, 32, 8, 4)  # 2 layers, B 2, Hkv 2 (default), S 12 + 20, D 32 // 4, fp32
    assert f"= {expected:,} B (2*layers*B*Hkv*S*D*bytes = {expected:,} B)" in out
    assert "check: cached greedy tokens == full uncached forward: yes" in out


@pytest.mark.parametrize("extra", [
    ("--ragged", "--chunk", "5"),  # left-padded rows of different lengths, chunks that do not divide 12
    ("--kv-heads", "1", "--window", "6"),  # MQA with a sliding window shorter than the run
    ("--kv-heads", "4", "--dtype", "bfloat16", "--no-check"),  # MHA in bf16 (greedy ties are possible: no check)
])
def test_variants_run(capsys, extra):
    code, out, _ = run(capsys, *extra)
    assert code == 0
    assert "tokens/s" in out
    if "--no-check" not in extra:
        assert "== full uncached forward: yes" in out


def test_too_small_capacity_is_a_clear_error(capsys):
    code, _, err = run(capsys, "--capacity", "25")
    assert code == 2
    assert "KV cache overflow: it holds 25 of 25 slots and cannot take 1 more" in err  # the prompt fit; decode did not


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(flags) >= 15
    assert all(action.help for action in flags), [a.dest for a in flags if not a.help]


def test_chunking_does_not_change_the_tokens():
    # fp64 so that greedy picks cannot flip on roundoff: prefill in 1, 5 or 12-token chunks gives one result.
    torch.manual_seed(0)
    model = TinyDecoder(64, 32, 2, 4, 2, window=7).double().eval()
    ids, positions, valid = left_padded_prompts(3, 12, 64, ragged=True, generator=torch.Generator().manual_seed(0))
    results = [generate(model, ids, positions, valid, 10, chunk, 22, progress=False)[0] for chunk in (1, 5, 12)]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    same, margin = check_against_full_forward(model, ids, positions, valid, results[0])
    assert same and margin > 1e-9


def test_the_check_notices_wrong_tokens():
    torch.manual_seed(0)
    model = TinyDecoder(64, 32, 2, 4, 2).double().eval()
    ids, positions, valid = left_padded_prompts(2, 8, 64, ragged=False, generator=torch.Generator().manual_seed(0))
    tokens = generate(model, ids, positions, valid, 6, 8, 14, progress=False)[0]
    wrong = tokens.clone()
    wrong[1, 3] = (wrong[1, 3] + 1) % 64
    assert check_against_full_forward(model, ids, positions, valid, tokens)[0]
    assert not check_against_full_forward(model, ids, positions, valid, wrong)[0]


@pytest.mark.parametrize("extra", [("--ragged", "--paged", "4"), ("--ragged", "--paged", "1", "--window", "5")])
def test_paged_serving_gives_the_contiguous_caches_greedy_tokens(capsys, extra):
    # each row's real tokens (no padding) as a sequence of a PagedKVCache, prefilled in one packed call
    code, out, _ = run(capsys, *extra)
    assert code == 0
    assert re.search(r"paged \(page \d+\): same greedy tokens as the contiguous cache: yes; 40 tokens in", out)
    assert "a contiguous cache reserves 64)" in out  # 2 rows x (12 + 20)
