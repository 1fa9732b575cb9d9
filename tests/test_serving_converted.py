"""engine/serving/converted.py: a ``.gguf`` file converted once and kept as a model directory. A tiny GGUF (a 2-layer
Llama with random F32 weights and a 32-token byte-level BPE vocabulary, written here with the gguf package) stands in
for SmolLM2's: the cached load must give the converted load's weights and tokenizer exactly, and an entry that is
truncated, corrupt, partial or for another key must be converted again, never used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from engine.serving import converted  # noqa: E402
from engine.serving.model import load_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKENS = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "Ġa"]
TEXT = "ab a b cab"


def write_tiny_gguf(path: Path, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 64) -> None:
    """A llama GGUF as llama.cpp's converter writes one: metadata, a gpt2 (byte-level BPE) tokenizer, F32 tensors
    in GGUF's [out, in] row order."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))  # 3: control tokens
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    shapes = {"token_embd": (len(TOKENS), hidden), "output_norm": (hidden,), "output": (len(TOKENS), hidden)}
    for i in range(layers):
        shapes |= {f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.ffn_norm": (hidden,),
                   f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (kv_heads * head_dim, hidden),
                   f"blk.{i}.attn_v": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output": (hidden, hidden),
                   f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
                   f"blk.{i}.ffn_down": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", (0.2 * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def load(path: Path, root: Path, dtype: torch.dtype = torch.float32) -> tuple:
    """``(model, tokenizer, what load_model reported)``."""
    said = []
    model, tokenizer, name = load_model(str(path), dtype=dtype, cache_root=root, report=said.append)
    assert name == path.name and len(said) == 1
    return model, tokenizer, said[0]


def assert_same(a: tuple, b: tuple) -> None:
    """The same weights bit for bit, the same config and the same tokenizer."""
    (model_a, tokenizer_a), (model_b, tokenizer_b) = a[:2], b[:2]
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert state_a[key].dtype == state_b[key].dtype and torch.equal(state_a[key], state_b[key]), key
    configs = [{k: v for k, v in m.config.to_diff_dict().items() if k != "quantization_config"}  # the GGUF note
               for m in (model_a, model_b)]
    assert configs[0] == configs[1]
    assert model_a.generation_config.to_diff_dict() == model_b.generation_config.to_diff_dict()
    assert tokenizer_a(TEXT).input_ids == tokenizer_b(TEXT).input_ids
    assert tokenizer_a.all_special_ids == tokenizer_b.all_special_ids and len(tokenizer_a) == len(tokenizer_b)


def the_entry(root: Path) -> Path:
    entries = [p for p in root.iterdir()]
    assert len(entries) == 1 and not entries[0].name.startswith("."), entries  # no temporary folder left behind
    return entries[0]


def test_a_second_load_gives_the_converted_weights_exactly(tiny_gguf, tmp_path):
    root = tmp_path / "cache"
    plain = load_model(str(tiny_gguf), cache=False)  # transformers' GGUF loader, no cache
    first = load(tiny_gguf, root)
    entry = the_entry(root)
    assert first[2] == f"converted tiny.gguf and cached it at {entry}"
    second = load(tiny_gguf, root)
    assert second[2] == f"loaded converted weights from {entry}"
    assert_same(first, second)
    assert_same(plain, second)
    assert not hasattr(second[0].config, "quantization_config") and second[0].config._attn_implementation == "engine"
    assert converted.invalid_reason(entry, converted.cache_key(tiny_gguf, torch.float32)) is None


def rewrite(path: Path, data: bytes) -> None:
    """``path`` replaced by a new file holding ``data`` (a loaded model maps the old one: changing that file in place
    would pull its pages from under the model, a SIGBUS)."""
    path.with_suffix(".new").write_bytes(data)
    os.replace(path.with_suffix(".new"), path)


def corrupt_weights_truncated(entry: Path) -> None:  # a copy cut short
    weights = entry / "model.safetensors"
    rewrite(weights, weights.read_bytes()[:weights.stat().st_size // 2])


def corrupt_weights_one_byte(entry: Path) -> None:  # the same size: only the digest can tell
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x40
    rewrite(weights, bytes(data))


def corrupt_manifest_missing(entry: Path) -> None:  # a partial entry: its manifest is written last
    (entry / converted.MANIFEST).unlink()


def corrupt_tokenizer_missing(entry: Path) -> None:
    (entry / "tokenizer.json").unlink()


def corrupt_manifest_garbled(entry: Path) -> None:
    (entry / converted.MANIFEST).write_text("{not json")


@pytest.mark.parametrize("damage, reason", [
    (corrupt_weights_truncated, "model.safetensors holds"),
    (corrupt_weights_one_byte, "model.safetensors's sha256 is not the manifest's"),
    (corrupt_manifest_missing, "no manifest.json (a partial entry)"),
    (corrupt_tokenizer_missing, "tokenizer.json is missing"),
    (corrupt_manifest_garbled, "manifest.json unreadable"),
])
def test_a_damaged_entry_is_converted_again(tiny_gguf, tmp_path, damage, reason):
    root = tmp_path / "cache"
    first = load(tiny_gguf, root)
    entry = the_entry(root)
    damage(entry)
    assert reason in converted.invalid_reason(entry, converted.cache_key(tiny_gguf, torch.float32))
    rebuilt = load(tiny_gguf, root)
    assert rebuilt[2].startswith(f"converted tiny.gguf and cached it at {entry} (the entry there was rebuilt: ")
    assert reason in rebuilt[2]
    assert the_entry(root) == entry
    assert_same(first, rebuilt)
    assert load(tiny_gguf, root)[2] == f"loaded converted weights from {entry}"


def test_the_key_changes_with_the_dtype_and_the_file(tiny_gguf, tmp_path):
    root = tmp_path / "cache"
    key32, key16 = converted.cache_key(tiny_gguf, torch.float32), converted.cache_key(tiny_gguf, torch.bfloat16)
    assert key32["dtype"] == "float32" and key16["dtype"] == "bfloat16"
    assert converted.entry_folder(root, key32) != converted.entry_folder(root, key16)
    load(tiny_gguf, root)
    model16, _, said = load(tiny_gguf, root, torch.bfloat16)
    assert said.startswith("converted ") and next(model16.parameters()).dtype == torch.bfloat16
    assert len(list(root.iterdir())) == 2
    assert_same((model16, _), load_model(str(tiny_gguf), dtype=torch.bfloat16, cache=False))
    # the file rewritten (another size or time): its old entry is not used
    before = converted.cache_key(tiny_gguf, torch.float32)
    write_tiny_gguf(tiny_gguf, ffn=96)
    os.utime(tiny_gguf, ns=(before["mtime_ns"] + 10**9, before["mtime_ns"] + 10**9))
    after = converted.cache_key(tiny_gguf, torch.float32)
    assert after["size"] != before["size"] and converted.entry_folder(root, after) != converted.entry_folder(root,
                                                                                                          before)
    model, _, said = load(tiny_gguf, root)
    assert said.startswith("converted ") and model.config.intermediate_size == 96


def test_an_entry_whose_manifest_holds_another_key_is_not_used(tiny_gguf, tmp_path):
    root = tmp_path / "cache"
    load(tiny_gguf, root)
    entry = the_entry(root)
    key = converted.cache_key(tiny_gguf, torch.float32)
    assert converted.invalid_reason(entry, {**key, "transformers": "0.0"}) == "manifest.json is for another key"


def test_a_conversion_that_fails_midway_leaves_no_entry(tiny_gguf, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    real_write = converted._write

    def write_then_fail(model, tokenizer, folder, key):
        real_write(model, tokenizer, folder, key)
        (folder / "model.safetensors").write_bytes(b"")
        raise OSError("disk full")

    monkeypatch.setattr(converted, "_write", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        load(tiny_gguf, root)
    assert list(root.iterdir()) == []  # neither an entry nor the temporary folder
    monkeypatch.undo()
    assert load(tiny_gguf, root)[2].startswith("converted ")
