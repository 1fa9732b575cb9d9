"""The transformers backend's translation layer: masks as positions/window/padding, the dense fallback,
scaling/softcap/dropout handling, and registration through the library's registries."""

import itertools
import os
import warnings

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

from engine import causal_attention  # noqa: E402
from tests.precision import assert_within_precision, plain_attention  # noqa: E402


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
    bias = torch.randn(1, 2, 4, 6)  # an additive mask that also carries a bias: mask and bias are told apart
    by_bias, _ = hf.engine_attention_forward(module, q, k, v, additive + bias)
    want = causal_attention(q, k, v, allowed=causal, bias=bias, causal=False).transpose(1, 2)
    torch.testing.assert_close(by_bias, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"must cover the S=6 keys .* got shape \(1, 1, 4, 1\)"):
        hf.engine_attention_forward(module, q, k, v, causal[None, None, :, -1:])  # would broadcast over keys
    torch.manual_seed(3)
    dropped, _ = hf.engine_attention_forward(module, q, k, v, None, dropout=0.5)
    torch.manual_seed(3)
    assert torch.equal(hf.engine_attention_forward(module, q, k, v, None, dropout=0.5)[0], dropped)
    assert not torch.allclose(dropped, by_none)  # dropout runs (seeded by torch's generator)
    for name in hf.UNSUPPORTED_ATTENTION_KWARGS:  # score-changing keywords are refused, never ignored
        with pytest.raises(ValueError, match=name):
            hf.engine_attention_forward(module, q, k, v, None, **{name: torch.zeros(2)})


def visible_by_rule(query_positions, key_positions, causal, window=None):
    """Bool ``[T, S]`` spelled out pair by pair (an oracle independent of window_mask): key j is visible to
    query i iff ``kp <= qp`` (when causal) and ``qp - window < kp`` (the library's ``kv > q - w``: w keys)."""
    rows = []
    for qp in query_positions.tolist():
        rows.append([(not causal or kp <= qp) and (window is None or kp > qp - window)
                     for kp in key_positions.tolist()])
    return torch.tensor(rows, dtype=torch.bool)


def loop_oracle(q, k, v, visible, scale):
    """float64, one query at a time: ``[B, T, Hq, D]``; query head h reads KV head ``h // G``; a query that
    sees no key gives 0. visible: bool ``[T, S]`` or ``[B, T, S]``."""
    batch, q_heads, t, _ = q.shape
    group = q_heads // k.shape[1]
    visible = visible.expand(batch, *visible.shape[-2:])  # [B, T, S]
    out = torch.zeros(batch, t, q_heads, v.shape[-1], dtype=torch.float64)
    for b, h, i in itertools.product(range(batch), range(q_heads), range(t)):
        keys = visible[b, i].nonzero().flatten()
        if len(keys):
            scores = (k[b, h // group, keys].double() @ q[b, h, i].double()) * scale  # [n]
            out[b, i, h] = torch.softmax(scores, dim=0) @ v[b, h // group, keys].double()  # [D]
    return out


def assert_matches_oracle(out, q, k, v, visible, scale):
    """The engine's fp32 output against the float64 loop, by the suite's rule (twice a plain fp32 run's error)."""
    plain = plain_attention(q, k, v, visible.unsqueeze(-3), scale, torch.float32).transpose(1, 2)  # [B, T, Hq, D]
    assert_within_precision(out, loop_oracle(q, k, v, visible, scale), plain, torch.float32)


# attention_mask=None: (is_causal argument, module.is_causal, sliding_window, visibility rule). 4 queries sit at
# the last 4 of 6 key positions when causal.
NO_MASK = [
    (None, True, None, dict(causal=True)),  # the module's flag: causal
    (None, True, 2, dict(causal=True, window=2)),  # a window of 2 keys, own included
    (None, True, 1, dict(causal=True, window=1)),  # a window of 1: the own key only
    (True, False, 3, dict(causal=True, window=3)),  # is_causal=True overrides the module
    (False, True, None, dict(causal=False)),  # is_causal=False overrides the module: every key
    (None, False, None, dict(causal=False)),  # an encoder module: every key
]


@pytest.mark.parametrize("is_causal,module_is_causal,sliding_window,rule", NO_MASK)
def test_no_mask_follows_is_causal_and_the_window(is_causal, module_is_causal, sliding_window, rule):
    torch.manual_seed(2)
    module = torch.nn.Module()
    module.is_causal = module_is_causal
    q, k, v = torch.randn(2, 4, 4, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # GQA, G = 2
    out, _ = hf.engine_attention_forward(module, q, k, v, None, scaling=0.4, is_causal=is_causal,
                                         sliding_window=sliding_window)
    visible = visible_by_rule(torch.arange(2, 6), torch.arange(6), **rule)  # [T, S]
    assert_matches_oracle(out, q, k, v, visible, 0.4)


def test_no_mask_bidirectional_window_is_refused():
    module = torch.nn.Module()
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sliding_window=2 with is_causal=False and no attention_mask"):
        hf.engine_attention_forward(module, q, k, v, None, is_causal=False, sliding_window=2)


# A 0-d tensor q_offset (what static caches give): (mask function, local_size, q_length, kv_length, q_offset,
# kv_offset, window of the rule).
TENSOR_OFFSET = [
    (causal_mask_function, None, 3, 7, 4, 0, None),  # a chunk of 3 after 4 cached tokens
    (sliding_window_causal_mask_function(3), 3, 2, 4, 7, 5, 3),  # sliding, 2 queries after a trimmed cache
]


@pytest.mark.parametrize("mask_function,local_size,t,s,q_offset,kv_offset,window", TENSOR_OFFSET)
def test_tensor_q_offset(mask_function, local_size, t, s, q_offset, kv_offset, window):
    torch.manual_seed(3)
    padding = PADDING[:, : kv_offset + s]
    args = dict(batch_size=2, q_length=t, kv_length=s, kv_offset=kv_offset, mask_function=mask_function,
                attention_mask=padding, local_size=local_size)
    mask = hf.engine_mask(**args, q_offset=torch.tensor(q_offset))
    assert torch.equal(mask.query_positions, torch.arange(q_offset, q_offset + t))
    assert torch.equal(spelled_out(mask, 2), sdpa_mask(**args, q_offset=q_offset, allow_is_causal_skip=False))
    q, k, v = torch.randn(2, 4, t, 8), torch.randn(2, 2, s, 8), torch.randn(2, 2, s, 8)
    out, _ = hf.engine_attention_forward(torch.nn.Module(), q, k, v, mask, scaling=0.4)
    key_positions = torch.arange(kv_offset, kv_offset + s)
    visible = visible_by_rule(torch.arange(q_offset, q_offset + t), key_positions, True, window)  # [T, S]
    visible = visible & padding[:, kv_offset:].bool()[:, None, :]  # [B, T, S]
    assert_matches_oracle(out, q, k, v, visible, 0.4)
    with pytest.raises(ValueError, match=r"q_offset must be an int or a one-element integer tensor.*shape \(2,\)"):
        hf.engine_mask(**args, q_offset=torch.tensor([q_offset, q_offset]))


def test_extra_keys_before_every_window_are_dropped_and_other_mismatches_raise():
    # transformers' dynamic sliding layer with sliding_window=1 returns every key while its mask describes
    # the last one: keys 0..12 for a decode at position 12, mask kv_offset=12, S=1.
    torch.manual_seed(4)
    module = torch.nn.Module()
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    window_1 = sliding_window_causal_mask_function(1)
    mask = hf.engine_mask(batch_size=1, q_length=1, kv_length=1, q_offset=12, kv_offset=12,
                          mask_function=window_1, local_size=1)
    out, _ = hf.engine_attention_forward(module, q, k, v, mask, scaling=0.4)
    visible = visible_by_rule(torch.tensor([12]), torch.arange(13), causal=True, window=1)  # [T, S]: key 12
    assert_matches_oracle(out, q, k, v, visible, 0.4)
    # A mask without a window, or keys that could be inside a window, cannot be placed: refuse, never guess.
    causal = hf.engine_mask(batch_size=1, q_length=1, kv_length=12, q_offset=12, kv_offset=1)
    with pytest.raises(ValueError, match=r"built for T=1 queries and S=12 keys but the layer got T=1 .* S=13"):
        hf.engine_attention_forward(module, q, k, v, causal)
    inside = hf.engine_mask(batch_size=1, q_length=1, kv_length=1, q_offset=12, kv_offset=12,
                            mask_function=sliding_window_causal_mask_function(2), local_size=2)
    with pytest.raises(ValueError, match=r"older than every query's sliding window \(window=2\), and these are not"):
        hf.engine_attention_forward(module, q, k, v, inside)
    with pytest.raises(ValueError, match=r"built for T=1 queries and S=1 keys but the layer got T=2"):
        hf.engine_attention_forward(module, torch.randn(1, 4, 2, 8), k, v, mask)


def test_registered_through_the_librarys_registries():
    assert ALL_ATTENTION_FUNCTIONS["engine"] is hf.engine_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["engine"] is hf.engine_mask
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward  # nothing else was replaced


def tiny_llama(**kwargs):
    torch.manual_seed(0)
    config = LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2), **kwargs})
    return AutoModelForCausalLM.from_config(config, attn_implementation="engine")


def register_spy(name: str) -> list:
    """Register the engine under ``name`` with an attention function that records each mask it is handed."""
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return hf.engine_attention_forward(module, query, key, value, attention_mask, **kwargs)

    hf.register(name)
    AttentionInterface.register(name, spy)
    return seen


def test_padded_forward_builds_no_dense_mask():
    seen = register_spy("engine-spy")
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


def test_training_with_attention_dropout_runs_the_engines_dropout():
    model = tiny_llama(attention_dropout=0.1).train()
    ids = torch.randint(0, 64, (1, 5))
    torch.manual_seed(7)
    first = model(ids).logits
    torch.manual_seed(7)
    assert torch.equal(model(ids).logits, first)  # reproducible from torch's generator
    model.eval()
    assert not torch.allclose(model(ids).logits, first)  # eval: dropout is 0


def test_output_attentions_warns_that_weights_are_not_materialised():
    model = tiny_llama().eval()
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad(), pytest.warns(UserWarning, match=r"never materialises attention weights.*'eager'"):
        out = model(ids, output_attentions=True)
    assert not out.attentions  # what the warning is about: no weights come back
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when no weights are asked for
        assert torch.equal(model(ids).logits, out.logits)


def test_every_layer_of_a_forward_runs_the_one_plan_its_mask_made():
    # the mask is built once per forward: its first layer plans (positions, padding, kernel), the others reuse it
    seen = register_spy("engine-plan-spy")
    model = tiny_llama(num_hidden_layers=4).eval()
    ids = torch.randint(0, 64, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("engine-plan-spy")
        got = model(ids, attention_mask=mask).logits
    assert len(seen) == 4 and all(m is seen[0] for m in seen) and len(seen[0].plans) == 1
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # row 0's pad queries differ by design
    torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-5, atol=1e-5)
