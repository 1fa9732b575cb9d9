"""transformers' DeepSeek V3 weights (a tiny random config, saved and loaded) decoded with the engine's absorbed MLA
over a latent cache (engine.integrations.transformers.latent) give the greedy tokens of transformers' eager
attention, contiguous and paged; the latent cache holds R + r numbers per token and layer."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from engine.integrations.transformers.latent import generate_absorbed, latent_layers  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.2,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random DeepSeek V3 saved to disk and loaded back with eager attention."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**TINY)
    path = tmp_path_factory.mktemp("deepseek-v3")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("page_size", [None, 4])
def test_absorbed_mla_gives_eagers_greedy_tokens(saved, page_size):
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = saved.generate(ids, max_new_tokens=12, do_sample=False)
    got = generate_absorbed(saved, ids, max_new_tokens=12, page_size=page_size)
    assert torch.equal(got, want)


def test_the_latent_layers_hold_the_checkpoints_weights_and_a_small_cache(saved):
    layers = latent_layers(saved)
    assert len(layers) == 2
    for layer, block in zip(layers, saved.model.layers):
        theirs = block.self_attn.state_dict()
        assert all(torch.equal(p, theirs[name]) for name, p in layer.state_dict().items())
    cache = layers[0].new_cache(1, 100)
    expanded = 100 * 4 * (16 + 8 + 16) * 4  # what an expanded cache holds: H (n + r + v) numbers per token
    assert cache.nbytes == 100 * (32 + 8) * 4 and expanded / cache.nbytes == 4.0


def test_a_yarn_scaled_or_non_latent_model_is_refused(saved):
    yarn = transformers.DeepseekV3Config(**TINY, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                  "rope_theta": 10000.0,
                                                                  "original_max_position_embeddings": 64})
    model = transformers.AutoModelForCausalLM.from_config(yarn)
    with pytest.raises(ValueError, match="plain RoPE"):
        latent_layers(model)
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="no multi-head latent attention"):
        latent_layers(llama)
    with pytest.raises(ValueError, match="ids must be an int64 tensor"):
        generate_absorbed(saved, torch.zeros(2, 3), 4)
