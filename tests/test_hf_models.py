"""The engine as a transformers backend, on small random-weight models built from configs (offline).

For each decoder family: logits of a left-padded batch match ``eager``, greedy ``generate()`` gives the
same ids with the dynamic and the static cache (and as eager), and chunked prefill matches. A BERT-style
encoder gives the same hidden states as eager.
"""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("engine.integrations.transformers")  # registers attn_implementation="engine"

from transformers import AutoModelForCausalLM, BertConfig, BertModel, DynamicCache  # noqa: E402

from tests.precision import assert_within_precision  # noqa: E402

PROMPT, NEW_TOKENS, VOCAB = 12, 24, 128
# initializer_range 0.2 and untied embeddings: logits far apart (greedy ids are robust) and varied tokens.
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
             eos_token_id=None, pad_token_id=0, bos_token_id=1)

# Each family: its config and what it exercises. Windows (5) are shorter than the prompt (12) + new tokens.
FAMILIES = {
    "llama-gqa": lambda: transformers.LlamaConfig(**SMALL, num_key_value_heads=2),  # GQA, G = 2
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_key_value_heads=1, head_dim=16),  # MQA + q/k norms
    "qwen2-sliding": lambda: transformers.Qwen2Config(  # layer 0 full, layer 1 sliding (hybrid cache)
        **SMALL, num_key_value_heads=2, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "mistral-sliding": lambda: transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=5),
    "gemma2-softcap": lambda: transformers.Gemma2Config(  # sliding/full alternating, score and logit softcaps
        **SMALL, num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=3.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=24),
    "gpt-oss-sinks": lambda: transformers.GptOssConfig(  # attention sinks, sliding/full alternating, MoE
        **SMALL, num_key_value_heads=2, head_dim=16, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
        experts_implementation="eager",  # the grouped-mm experts take no fp64 (the oracle runs in fp64)
        layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0}),
}


def _large_sinks(model) -> None:
    """gpt-oss initialises its sinks near 0 (~0.1); spread them over [-2, 3] so that they weigh in every row."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            with torch.no_grad():
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.shape[0]))


def build(family: str, implementation: str = "eager"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation=implementation)
    _large_sinks(model)
    return model.eval()


def left_padded_batch():
    """Three prompts of 12, 9 and 5 real tokens, left-padded to 12: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, PROMPT), generator=g)
    mask = torch.ones(3, PROMPT, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def positions_of(mask):
    """Positions that count real tokens only (what generate() passes): left pads do not shift RoPE."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def unpadded_reference(model, ids, mask, output="logits"):
    """fp64 eager run of each row alone, without its padding: the oracle at real tokens (pads hold NaN).

    (A padded fp64 eager run is no oracle: its fp64 mask minimum turns into -inf in eager's fp32 softmax,
    so fully masked pad rows become NaN and leak into real rows through their values.)"""
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation("eager")
    rows = []
    for row_ids, row_mask in zip(ids, mask.bool()):
        out = getattr(reference(row_ids[row_mask][None]), output)[0]  # [n, V]
        row = torch.full((ids.shape[1], out.shape[-1]), float("nan"), dtype=torch.float64)
        row[row_mask] = out
        rows.append(row)
    return torch.stack(rows)  # [B, T, V]


def assert_logits_within_precision(engine, eager, reference, where):
    """The suite's rule (tests/precision.py) at real tokens: the engine's error against the fp64 oracle is at
    most twice eager's fp32 error plus a few fp32 roundoffs."""
    assert_within_precision(engine[where], reference[where], eager[where], torch.float32)


def greedy(model, ids, mask, new_tokens=NEW_TOKENS, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_left_padded_logits_match_eager(family):
    model = build(family)
    ids, mask = left_padded_batch()
    real = mask.bool()  # pad queries differ by design: eager averages masked values, the engine returns 0
    positions = positions_of(mask)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, position_ids=positions).logits  # [B, T, V]
        reference = unpadded_reference(model, ids, mask)
        model.set_attn_implementation("engine")
        engine = model(ids, attention_mask=mask, position_ids=positions).logits
    assert model.config._attn_implementation == "engine"
    assert_logits_within_precision(engine, eager, reference, real)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_same_ids_with_dynamic_and_static_cache(family):
    model = build(family, "engine")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        dynamic = greedy(model, ids, mask)
        static = greedy(model, ids, mask, cache_implementation="static")
        model.set_attn_implementation("eager")
        eager = greedy(model, ids, mask)
    assert torch.equal(dynamic, static)
    assert torch.equal(dynamic, eager)
    assert len(set(dynamic.flatten().tolist())) > 10  # the check is not vacuous: varied tokens


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_prefill_matches_one_prefill(family):
    # Prefill the padded prompt in chunks of 5 (12 = 5 + 5 + 2, not a multiple) through the cache.
    model = build(family, "engine")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, position_ids=positions_of(mask)).logits  # [B, T, V]
        cache, chunks = DynamicCache(config=model.config), []
        for start in range(0, PROMPT, 5):
            end = min(start + 5, PROMPT)
            chunks.append(model(ids[:, start:end], attention_mask=mask[:, :end],
                                position_ids=positions_of(mask)[:, start:end],
                                cache=cache, use_cache=True).logits)
        chunked = torch.cat(chunks, dim=1)
        reference = unpadded_reference(model, ids, mask)
        assert torch.equal(greedy(model, ids, mask, prefill_chunk_size=5), greedy(model, ids, mask))
    assert_logits_within_precision(chunked, whole, reference, mask.bool())


def test_the_window_and_the_softcap_matter_in_these_configs():
    # Guards the tests above: if the engine ignored the window, the softcap or the sinks, they would have to fail.
    ids, mask = left_padded_batch()
    with torch.no_grad():
        for family, field, off in [("mistral-sliding", "sliding_window", 10**6),
                                   ("gemma2-softcap", "attn_logit_softcapping", None),
                                   ("gpt-oss-sinks", "sinks", torch.nn.Parameter(torch.full((4,), -1e4)))]:
            model = build(family)
            windowed = model(ids, attention_mask=mask).logits
            setattr(model.config, field, off)
            for layer in model.model.layers:
                if hasattr(layer.self_attn, field):
                    setattr(layer.self_attn, field, off)
            changed = model(ids, attention_mask=mask).logits
            assert (windowed - changed)[mask.bool()].abs().max() > 1e-3, family


def test_bert_encoder_matches_eager():
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertModel(config, add_pooling_layer=False).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0  # right padding, as encoders use
    mask[2, 3:] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).last_hidden_state  # [B, T, E]
        reference = copy.deepcopy(model).double()(ids, attention_mask=mask).last_hidden_state  # no empty rows
        model.set_attn_implementation("engine")
        engine = model(ids, attention_mask=mask).last_hidden_state
        changed = ids.clone()
        changed[0, -1] = (changed[0, -1] + 1) % VOCAB
        later = model(changed, attention_mask=mask).last_hidden_state
    everywhere = torch.ones(3, 10, dtype=torch.bool)  # pad queries still see real keys: all rows compare
    assert_logits_within_precision(engine, eager, reference, everywhere)
    assert (later[0, 0] - engine[0, 0]).abs().max() > 1e-4  # bidirectional: token 0 reads the last token


def test_mistral_window_of_one_decodes_like_the_uncached_forward():
    # sliding_window=1: each token sees only itself. transformers' DynamicSlidingWindowLayer then keeps every key
    # (its slice [-w + 1:] is [0:]) while the mask describes only the newest one; the engine drops the older keys,
    # which lie outside every window. Oracle: eager without a cache, where the mask alone decides.
    config = transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="engine").eval()
    ids, mask = left_padded_batch()
    step_ids = torch.randint(3, VOCAB, (3, 1), generator=torch.Generator().manual_seed(2))
    full_ids, full_mask = torch.cat([ids, step_ids], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, position_ids=positions_of(mask), cache=cache, use_cache=True)
        decoded = model(step_ids, attention_mask=full_mask, position_ids=positions_of(full_mask)[:, -1:],
                        cache=cache, use_cache=True).logits  # [B, 1, V]: 13 keys, a mask for 1
        dynamic = greedy(model, ids, mask, new_tokens=8)  # 8 tokens: the uncached oracle is slow
        static = greedy(model, ids, mask, new_tokens=8, cache_implementation="static")
        model.set_attn_implementation("eager")
        uncached = greedy(model, ids, mask, new_tokens=8, use_cache=False)
        eager = model(full_ids, attention_mask=full_mask, position_ids=positions_of(full_mask)).logits[:, -1:]
        reference = unpadded_reference(model, full_ids, full_mask)[:, -1:]
    assert_logits_within_precision(decoded, eager, reference, torch.ones(3, 1, dtype=torch.bool))
    assert torch.equal(dynamic, uncached) and torch.equal(static, uncached)
    assert len(set(dynamic.flatten().tolist())) > 8  # varied tokens
