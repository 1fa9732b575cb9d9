"""The transformers backend's translation layer: masks as positions/window/padding, the dense fallback,
scaling/softcap/dropout handling, and registration through the library's registries."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("engine.integrations.transformers")

from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402


def spelled_out(mask: "hf.EngineMask", batch: int) -> torch.Tensor:
    """The bool ``[B, 1, T, S]`` an EngineMask stands for: position rule & allowed."""
    qp, kp = mask.query_positions, mask.key_positions
    rule = (kp[None, :] <= qp[:, None]) if mask.causal else torch.ones(len(qp), len(kp), dtype=torch.bool)
    allowed = mask.allowed()
    full = rule if allowed is None else rule & allowed
    return full.expand(batch, 1, len(qp), len(kp))


PADDING = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])  # row 0 left-padded by 2; 9 cache slots


# (mask function, local_size, q_length, kv_length, q_offset, kv_offset): prefill, chunk, decode, sliding
# decode with a trimmed cache (kv_offset > 0), bidirectional.
RECOGNISED = [
    (causal_mask_function, None, 9, 9, 0, 0),  # prefill
    (causal_mask_function, None, 3, 7, 4, 0),  # a chunk of 3 after 4 cached tokens
    (causal_mask_function, None, 1, 9, 8, 0),  # one-token decode
    (sliding_window_causal_mask_function(3), 3, 5, 5, 0, 0),  # sliding prefill
    (sliding_window_causal_mask_function(3), 3, 1, 3, 8, 6),  # sliding decode: cache keeps the last 2
    (bidirectional_mask_function, None, 9, 9, 0, 0),  # encoder
]


@pytest.mark.parametrize("mask_function,local_size,t,s,q_offset,kv_offset", RECOGNISED)
@pytest.mark.parametrize("padded", [False, True])
def test_recognised_masks_stand_for_the_librarys_dense_mask(mask_function, local_size, t, s, q_offset,
                                                            kv_offset, padded):
    padding = PADDING[:, : kv_offset + s] if padded else None
    args = dict(batch_size=2, q_length=t, kv_length=s, q_offset=q_offset, kv_offset=kv_offset,
                mask_function=mask_function, attention_mask=padding, local_size=local_size)
    mask = hf.engine_mask(**args)
    assert mask.dense is None  # no [B, 1, T, S] tensor was built
    dense = sdpa_mask(**args, allow_is_causal_skip=False)  # [B, 1, T, S]
    assert torch.equal(spelled_out(mask, 2), dense)


@pytest.mark.parametrize("mask_function,local_size", [
    (chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)), 3),  # chunked attention (Llama 4)
    (and_masks(causal_mask_function, lambda b, h, q, kv: kv % 2 == 0), None),  # a custom overlay
    (sliding_window_causal_mask_function(4), 3),  # window and local_size disagree: do not guess
])
def test_other_masks_fall_back_to_the_librarys_dense_mask(mask_function, local_size):
    args = dict(batch_size=2, q_length=6, kv_length=6, mask_function=mask_function,
                attention_mask=PADDING[:, :6], local_size=local_size)
    mask = hf.engine_mask(**args)
    assert mask.dense is not None and not mask.causal
    assert torch.equal(spelled_out(mask, 2), sdpa_mask(**args, allow_is_causal_skip=False))


def test_fully_masked_rows_give_zero_and_scaling_and_softcap_pass_through():
    torch.manual_seed(0)
    module = torch.nn.Module()
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    padding = torch.tensor([[0, 1, 1], [1, 1, 1]])
    mask = hf.engine_mask(batch_size=2, q_length=3, kv_length=3, attention_mask=padding)
    out, weights = hf.engine_attention_forward(module, q, k, v, mask, scaling=0.3, softcap=2.0)
    assert weights is None and out.shape == (2, 3, 4, 8)  # [B, T, Hq, D]
    assert torch.equal(out[0, 0], torch.zeros(4, 8))  # row 0's first query sees only a pad key
    # eager's formula (GQA by repeating heads, softcap after scaling, additive mask) on the real rows
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = 2.0 * torch.tanh(q @ kr.transpose(-2, -1) * 0.3 / 2.0)
    visible = spelled_out(mask, 2)
    expected = (torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ vr).transpose(1, 2)
    torch.testing.assert_close(out[0, 1:], expected[0, 1:], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], expected[1], rtol=0, atol=1e-6)


def test_caller_masks_and_no_mask():
    torch.manual_seed(1)
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    causal = torch.arange(6)[None, :] <= torch.arange(2, 6)[:, None]  # queries at the last 4 positions
    additive = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]  # eager-style [1, 1, T, S]
    by_bool, _ = hf.engine_attention_forward(module, q, k, v, causal[None, None])
    by_float, _ = hf.engine_attention_forward(module, q, k, v, additive)
    by_none, _ = hf.engine_attention_forward(module, q, k, v, None)
    assert torch.equal(by_bool, by_float) and torch.equal(by_bool, by_none)
    windowed, _ = hf.engine_attention_forward(module, q, k, v, None, sliding_window=2)
    assert not torch.allclose(windowed, by_none)
    with pytest.raises(ValueError, match="bias"):
        hf.engine_attention_forward(module, q, k, v, additive + 0.5)
    with pytest.raises(ValueError, match="dropout"):
        hf.engine_attention_forward(module, q, k, v, None, dropout=0.1)
    for name in hf.UNSUPPORTED_ATTENTION_KWARGS:  # score-changing keywords are refused, never ignored
        with pytest.raises(ValueError, match=name):
            hf.engine_attention_forward(module, q, k, v, None, **{name: torch.zeros(2)})


def test_registered_through_the_librarys_registries():
    assert ALL_ATTENTION_FUNCTIONS["engine"] is hf.engine_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["engine"] is hf.engine_mask
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # nothing else was replaced


def tiny_llama(**kwargs):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, **kwargs)
    return AutoModelForCausalLM.from_config(config, attn_implementation="engine")


def test_padded_forward_builds_no_dense_mask():
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return hf.engine_attention_forward(module, query, key, value, attention_mask, **kwargs)

    hf.register("engine-spy")
    AttentionInterface.register("engine-spy", spy)
    model = tiny_llama().eval()
    model.set_attn_implementation("engine-spy")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7]))
    assert len(seen) == 2 and all(isinstance(m, hf.EngineMask) and m.dense is None for m in seen)
    assert seen[0].key_valid is not None  # padding travels as a [B, S] key mask


def test_packed_sequences_use_the_dense_fallback_and_match_eager():
    # position_ids that restart (two documents in one row, no attention_mask): the library's packed mask.
    model = tiny_llama().eval()
    ids = torch.randint(0, 64, (1, 9))
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        engine = model(ids, position_ids=position_ids, use_cache=False).logits  # no cache: packed detection
        model.set_attn_implementation("eager")
        eager = model(ids, position_ids=position_ids, use_cache=False).logits
        second_alone = model(ids[:, 4:]).logits
    torch.testing.assert_close(engine, eager, rtol=0, atol=64 * torch.finfo(torch.float32).eps * eager.abs().max())
    torch.testing.assert_close(engine[:, 4:], second_alone, rtol=0, atol=1e-4)  # documents do not mix


def test_training_with_attention_dropout_raises():
    model = tiny_llama(attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="dropout"):
        model(torch.randint(0, 64, (1, 5)))
    model.eval()
    assert model(torch.randint(0, 64, (1, 5))).logits.shape == (1, 5, 64)  # eval: dropout is 0
