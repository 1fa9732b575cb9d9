"""The memory calculator against the seeds' figures, exactly, in the unit each seed states."""

from __future__ import annotations

import argparse

import pytest

from engine.kv_cache import kv_cache_bytes
from lab.calculators import memory
from lab.calculators.memory import (
    PRESETS,
    crossover_context,
    decode_intensity,
    model_kv_bytes,
    score_matrix_bytes,
    seed_figures,
)
from lab.units import format_bytes, parse_bytes

GiB, MiB, GB = 2**30, 2**20, 10**9


def test_seed_000_one_fp32_head_at_8192_is_256_mib_exactly():
    assert score_matrix_bytes(1, 8192, bytes_per_element=4) == 256 * MiB


def test_seed_002_32_heads_at_8192_bf16_is_4_gib_exactly():
    assert score_matrix_bytes(32, 8192, bytes_per_element=2) == 4 * GiB


def test_seed_002_32_heads_at_32k_bf16_is_64_gib_exactly():
    assert score_matrix_bytes(32, 32768, bytes_per_element=2) == 64 * GiB


def test_seed_003_batch_8_fp16_is_34_4_gb_not_gib():
    computed = score_matrix_bytes(32, 8192, batch=8, bytes_per_element=2)
    assert computed == 34_359_738_368
    assert round(computed / GB, 1) == 34.4  # decimal gigabytes, as the seed states
    assert computed == 32 * GiB  # the same bytes read in GiB: 34.4 GiB would be wrong


def test_seed_003_llama_3_8b_kv_cache_at_128k_is_17_2_gb_and_weights_16_gb():
    llama = PRESETS["llama-3-8b"]
    kv = model_kv_bytes(llama, 131072, bytes_per_element=2)
    assert kv == 2 * 32 * 8 * 128 * 2 * 131072 == 16 * GiB
    assert round(kv / GB, 1) == 17.2
    assert llama.parameter_count() == 8_030_261_248  # published count, rebuilt from config.json
    assert round(llama.parameter_count() * 2 / GB) == 16


def test_published_parameter_counts_of_the_presets():
    assert PRESETS["llama-3-70b"].parameter_count() == 70_553_706_496  # "70.6B"
    assert PRESETS["qwen3-0.6b"].parameter_count() == 596_049_920  # "0.6B", tied embeddings


def test_seed_003_gqa_8_saves_8x_for_llama_3_70b():
    llama = PRESETS["llama-3-70b"]
    mha = model_kv_bytes(llama, 4096, kv_heads=llama.q_heads)
    gqa = model_kv_bytes(llama, 4096)
    assert mha == 8 * gqa


def test_seed_003_decode_intensity_is_the_gqa_ratio_in_fp16():
    assert decode_intensity(32, 32, 2) == 1
    assert decode_intensity(32, 4, 2) == 8
    assert decode_intensity(32, 1, 2) == 32


def test_crossover_context_is_the_first_length_where_the_cache_outgrows_the_weights():
    llama = PRESETS["llama-3-8b"]
    t = crossover_context(llama, 2)
    weights = llama.parameter_count() * 2
    assert model_kv_bytes(llama, t, bytes_per_element=2) > weights >= model_kv_bytes(llama, t - 1, bytes_per_element=2)
    assert t == 122_533 < 131072  # the seed: at 128k the cache is already bigger than the model


def test_every_seed_figure_matches_and_a_wrong_unit_would_not():
    figures = seed_figures()
    assert len(figures) == 10
    assert all(f.ok for f in figures), [f.claim for f in figures if not f.ok]
    gb_figure = next(f for f in figures if f.stated == 34.4)
    misread = memory.SeedFigure(**{**gb_figure.__dict__, "unit": "GiB"})
    assert not misread.ok  # 34.4 GiB is not what the formula gives


def test_kv_cache_formula_counts_k_and_v_per_layer():
    assert kv_cache_bytes(layers=1, batch=1, kv_heads=1, tokens=1, head_dim=1, dtype_bytes=1) == 2


@pytest.mark.parametrize("text, expected", [("80GiB", 80 * GiB), ("80 GB", 80 * GB), ("512mib", 512 * MiB),
                                            ("1000", 1000), ("1.5KiB", 1536)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "", "GiB", "-3GB", "0"])
def test_parse_bytes_rejects_nonsense_with_a_clear_message(text):
    with pytest.raises(ValueError, match="expected a size|positive"):
        parse_bytes(text)


def test_format_bytes_keeps_the_unit_asked_for():
    assert format_bytes(256 * MiB, "MiB") == "256 MiB"
    assert format_bytes(34_359_738_368, "GB", 1) == "34.4 GB"


def test_check_seeds_command_prints_each_figure_and_exits_zero(capsys):
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    assert memory.main(parser.parse_args(["--check-seeds"])) == 0
    out = capsys.readouterr().out
    assert "10 of 10 seed figures reproduced" in out
    assert "34.4 GB" in out and "256 MiB" in out and "MISMATCH" not in out


def test_check_seeds_exits_nonzero_on_a_mismatch(monkeypatch, capsys):
    wrong = memory.SeedFigure("000", "a deliberately wrong figure", 255, "MiB", 0, 256 * MiB, "x")
    monkeypatch.setattr(memory, "seed_figures", lambda: [wrong])
    assert memory.check_seeds() == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_preset_and_free_form_runs_write_results(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    args = parser.parse_args(["--model", "qwen3-0.6b", "--context", "8192,32k", "--out", str(tmp_path)])
    assert memory.main(args) == 0
    assert (tmp_path / "memory.json").exists() and (tmp_path / "memory.csv").exists()
    assert "Hq = 16, Hkv = 8" in capsys.readouterr().out
    assert memory.main(parser.parse_args(["--heads", "32", "--kv-heads", "5"])) == 2  # 32 % 5 != 0


def test_context_flag_rejects_unparsable_lengths():
    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--context", "12x"])
    assert parser.parse_args(["--context", "32k,128k"]).context == [32768, 131072]
