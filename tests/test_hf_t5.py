"""T5 (encoder-decoder with a learned relative-position bias) with ``attn_implementation="engine"``: the
bidirectional encoder, the causal decoder and the cross-attention each get T5's ``position_bias`` as the engine's
``bias``. Small random-weight config, offline; padded batches on both sides."""

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("engine.integrations.transformers")  # registers attn_implementation="engine"

from tests.precision import assert_within_precision  # noqa: E402

VOCAB = 128


def build(implementation: str = "eager"):
    # initializer_factor 5: logits far apart (varied greedy tokens) and a relative bias of std ~0.6 that matters
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=64,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=None,
                                   tie_word_embeddings=False, initializer_factor=5.0)
    torch.manual_seed(3)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.set_attn_implementation(implementation)
    return model


def batch():
    """Encoder rows of 12, 9 and 5 real tokens (right-padded), decoder rows of 7, 7 and 4 (right-padded)."""
    g = torch.Generator().manual_seed(1)
    ids, decoder_ids = torch.randint(3, VOCAB, (3, 12), generator=g), torch.randint(3, VOCAB, (3, 7), generator=g)
    mask, decoder_mask = torch.ones(3, 12, dtype=torch.long), torch.ones(3, 7, dtype=torch.long)
    mask[1, 9:], mask[2, 5:], decoder_mask[2, 4:] = 0, 0, 0
    return dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, decoder_input_ids=decoder_ids,
                decoder_attention_mask=decoder_mask)


def test_t5_logits_and_encoder_states_match_eager_with_padding():
    model, inputs = build(), batch()
    with torch.no_grad():
        eager = model(**inputs)
        # fp64 eager of the padded batch is an oracle here: no row is fully masked (pads are keys only)
        reference = copy.deepcopy(model).double()(**inputs)
        model.set_attn_implementation("engine")
        engine = model(**inputs)
    for field in ("encoder_last_hidden_state", "logits"):  # encoder alone; decoder self- and cross-attention
        assert_within_precision(getattr(engine, field), getattr(reference, field), getattr(eager, field),
                                torch.float32)


def test_t5_greedy_generate_same_ids_as_eager_with_dynamic_and_static_cache():
    model, inputs = build("engine"), batch()
    prompt = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    kwargs = dict(max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        dynamic = model.generate(**prompt, **kwargs)
        static = model.generate(**prompt, **kwargs, cache_implementation="static")
        model.set_attn_implementation("eager")
        eager = model.generate(**prompt, **kwargs)
    assert torch.equal(dynamic, eager) and torch.equal(static, eager)
    assert len(set(dynamic.flatten().tolist())) > 10  # the check is not vacuous: varied tokens


def test_t5_gradients_reach_the_relative_bias_as_in_eager():
    """Training: position_bias requires grad, so it runs as a learned dense bias (the tiled kernel's backward).
    The engine's gradients of both bias tables are as close to an fp64 eager run's as fp32 eager's are."""
    grads = {}
    for implementation, dtype in (("eager", torch.float64), ("eager", torch.float32), ("engine", torch.float32)):
        model = build(implementation).to(dtype).train()
        model(**batch(), labels=batch()["decoder_input_ids"]).loss.backward()
        grads[implementation, dtype] = [p.grad for name, p in model.named_parameters()
                                        if "relative_attention_bias" in name]
    assert len(grads["eager", torch.float64]) == 2  # the encoder's and the decoder's tables
    for want, eager, engine in zip(*(grads[key] for key in (("eager", torch.float64), ("eager", torch.float32),
                                                              ("engine", torch.float32)))):
        assert want.abs().max() > 0
        assert_within_precision(engine, want, eager, torch.float32)


def test_the_relative_bias_matters_in_this_config():
    # Guards the tests above: an engine that ignored position_bias would have to fail them.
    model, inputs = build(), batch()
    with torch.no_grad():
        before = model(**inputs).logits
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.zero_()
        after = model(**inputs).logits
    assert (before - after).abs().max() > 1e-2
