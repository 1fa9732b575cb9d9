"""DeepSeek V3.2 and GLM-MoE-DSA (DeepSeek Sparse Attention) on ``attn_implementation="engine"``: their indexer reads
the mask (``attention_mask[:, 0]``, which the EngineMask gives as the dense rule), and their attention hands the
engine the top-k keys per query as ``indices``, taken as ``key_indices`` (never scattered into a dense mask). Logits
and greedy tokens equal eager's (which scatters the indices into a mask) on tiny random configs."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("engine.integrations.transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

import engine.integrations.transformers.mask as engine_masks  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, index_topk=5, index_n_heads=2, index_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
            max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False, eos_token_id=None,
            pad_token_id=0, bos_token_id=1)
FAMILIES = {"deepseek-v3.2": "DeepseekV32Config", "glm-moe-dsa": "GlmMoeDsaConfig"}


def pair(family: str, **overrides):
    config = getattr(transformers, FAMILIES[family])(**{**TINY, **overrides})
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_config(config, attn_implementation="engine").eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparse_attention_models_equal_eager_and_take_the_indices_as_key_indices(family, monkeypatch):
    eager, ours = pair(family)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    taken = []
    planned = engine_masks.EngineMask.plan_for
    monkeypatch.setattr(engine_masks.EngineMask, "plan_for",
                        lambda self, *a, **k: taken.append(a[7] if len(a) > 7 else k.get("key_indices"))
                        or planned(self, *a, **k))
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(taken) >= 2 and all(x is not None and x.shape == (2, 1, 40, 5) for x in taken)  # [B, 1, T, topk]
    with torch.no_grad():
        full = pair(family, index_topk=1000)[0](ids).logits
    assert (full - want).abs().max() > 1e-2  # the top-k selection changes these logits: it is not a no-op here
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, max_new_tokens=12, do_sample=False),
                           eager.generate(ids, max_new_tokens=12, do_sample=False))


def test_the_engine_mask_gives_a_model_that_reads_it_the_dense_rule():
    from engine.integrations.transformers.mask import EngineMask
    mask = EngineMask(torch.arange(3, 6), torch.arange(6), causal=True, window=2)
    dense = mask[:, 0]  # what DeepSeek V3.2's indexer reads
    want = (torch.arange(6)[None] <= torch.arange(3, 6)[:, None]) & (torch.arange(3, 6)[:, None] - torch.arange(6)
                                                                     < 2)
    assert dense.shape == (1, 3, 6) and torch.equal(dense[0], want)
