"""engine.latent.LatentAttention (MLA): the absorbed form over a latent cache equals the expanded form, and both
equal a float64 per-query loop written from MLA's definition on the layer's weights (no engine attention code)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.kernels.decode.native_build import native_unavailable
from engine.latent import LatentAttention
from engine.rope import apply_rope
from engine.shared_rows import shares_rows


def mla_oracle(layer: LatentAttention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[B, T, E]`` in float64: per head, keys ``[W_UK c_s | k_pe_s]`` and values ``W_UV c_s`` built token by
    token from the weights, each query's softmax over the keys at positions <= its own."""
    w = {name: p.detach().double() for name, p in layer.named_parameters()}
    x = x.double()
    heads, n, r, v, rank = layer.num_heads, layer.nope, layer.rope, layer.v_head_dim, layer.kv_lora_rank
    eps = layer.kv_a_layernorm.eps

    def norm(h, weight):
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight

    if layer.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = norm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(*x.shape[:2], heads, n + r)  # [B, T, H, n + r]
    a = x @ w["kv_a_proj_with_mqa.weight"].T  # [B, T, R + r]
    c, k_pe = norm(a[..., :rank], w["kv_a_layernorm.weight"]), a[..., rank:]
    q_pe = apply_rope(q[..., n:].transpose(1, 2), positions, layer.rope_base, layer.rope_pairing)  # [B, H, T, r]
    k_pe = apply_rope(k_pe[:, None], positions, layer.rope_base, layer.rope_pairing)[:, 0]  # [B, T, r]
    up = w["kv_b_proj.weight"].view(heads, n + v, rank)
    out = torch.zeros(*x.shape[:2], heads, v, dtype=torch.float64)
    for b in range(x.shape[0]):
        for h in range(heads):
            keys = torch.cat([c[b] @ up[h, :n].T, k_pe[b]], dim=-1)  # [S, n + r]
            values = c[b] @ up[h, n:].T  # [S, v]
            for i in range(x.shape[1]):
                query = torch.cat([q[b, i, h, :n], q_pe[b, h, i]])
                scores = keys @ query * layer.scale
                scores = scores.masked_fill(positions[b] > positions[b, i], float("-inf"))
                out[b, i, h] = torch.softmax(scores, 0) @ values
    return out.reshape(*x.shape[:2], heads * v) @ w["o_proj.weight"].T


def small_layer(q_lora: bool, pairing: str, seed: int = 0) -> LatentAttention:
    torch.manual_seed(seed)
    layer = LatentAttention(48, 3, kv_lora_rank=20, q_lora_rank=12 if q_lora else None, qk_nope_head_dim=8,
                            qk_rope_head_dim=6, v_head_dim=10, rope_pairing=pairing).double()
    for norm in [layer.kv_a_layernorm] + ([layer.q_a_layernorm] if q_lora else []):
        norm.weight.data.uniform_(0.5, 1.5)  # not ones: a dropped norm weight must show
    return layer


@settings(max_examples=12, deadline=None)
@given(q_lora=st.booleans(), pairing=st.sampled_from(["half", "interleaved"]), batch=st.integers(1, 2),
       prompt=st.integers(1, 6), steps=st.integers(0, 3), seed=st.integers(0, 100))
def test_absorbed_decode_over_a_latent_cache_equals_the_expanded_form_and_the_oracle(q_lora, pairing, batch,
                                                                                    prompt, steps, seed):
    layer = small_layer(q_lora, pairing, seed)
    x = torch.randn(batch, prompt + steps, 48, dtype=torch.float64)
    positions = torch.arange(prompt + steps).expand(batch, -1)
    want = mla_oracle(layer, x, positions)
    expanded = layer(x, absorbed=False)
    absorbed = layer(x, absorbed=True)
    cache = layer.new_cache(batch, prompt + steps)
    decoded = [layer(x[:, :prompt], cache=cache, absorbed=False)]  # prefill expanded, then absorbed steps
    decoded += [layer(x[:, i:i + 1], cache=cache) for i in range(prompt, prompt + steps)]
    for got in (expanded, absorbed, torch.cat(decoded, dim=1)):
        assert (got - want).abs().max().item() <= 1e-10
    assert cache.length == prompt + steps and cache.nbytes == batch * (prompt + steps) * 26 * 8  # R + r per token


def test_per_row_positions_and_a_paged_latent_cache_equal_the_oracle():
    layer = small_layer(True, "interleaved", 5)
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])  # row 1 continues at position 3
    want = mla_oracle(layer, x, positions)
    assert (layer(x, positions) - want).abs().max().item() <= 1e-10
    paged = layer.new_paged_cache(8, 2)
    seqs = [paged.add(), paged.add()]
    prefill = layer.forward_paged(torch.cat([x[0, :4], x[1, :1]]), paged, seqs, torch.tensor([0, 4, 5]))
    assert (prefill - torch.cat([want[0, :4], mla_oracle(layer, x[1:, :1], torch.zeros(1, 1, dtype=torch.long))[0]])
            ).abs().max().item() <= 1e-10
    step = layer.forward_paged(torch.stack([x[0, 4], x[1, 1]]), paged, seqs, torch.tensor([0, 1, 2]))
    zero_based = mla_oracle(layer, x[1:, :2], torch.arange(2)[None])
    assert (step - torch.stack([want[0, 4], zero_based[0, 1]])).abs().max().item() <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_absorbed_decode_step_in_fp32_and_bf16_reads_shared_rows_and_equals_the_expanded_form(dtype):
    layer = LatentAttention(64, 4, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
                            v_head_dim=16).to(dtype)
    cache = layer.new_cache(1, 40)
    x = torch.randn(1, 33, 64).to(dtype)
    with torch.no_grad():  # inference: the native kernel serves no gradients
        layer(x[:, :32], cache=cache)
        step = layer(x[:, 32:], cache=cache)
        full = layer(x, absorbed=False)[:, 32:]
    rows, latent, _, _ = cache.view()
    assert shares_rows(rows, latent) and latent.shape[-1] == 64 and rows.shape[-1] == 80
    if native_unavailable() is None:  # the step's call: 4 heads' absorbed queries against one KV head of rows
        assert engine.plan(torch.randn(1, 4, 1, 80).to(dtype), rows, latent).kernel == "decode_native"
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    assert (step.float() - full.float()).abs().max().item() <= tolerance * max(1.0, full.abs().max().item())


def test_bad_layers_and_calls_are_refused_naming_what_was_wrong():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        LatentAttention(32, 2, qk_rope_head_dim=5)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
        LatentAttention(32, 2, kv_lora_rank=0)
    with pytest.raises(ValueError, match="rope_pairing"):
        LatentAttention(32, 2, rope_pairing="neighbours")
    layer = LatentAttention(32, 2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=8)
    with pytest.raises(ValueError, match=r"x must be \[B, T, E\] with E = 32"):
        layer(torch.randn(1, 3, 31))
    with pytest.raises(ValueError, match="latent KVCache"):
        layer(torch.randn(1, 3, 32), cache=object())
    from engine.kv_cache import KVCache
    with pytest.raises(ValueError, match="latent KVCache"):
        layer(torch.randn(1, 3, 32), cache=KVCache(1, 1, 8, 20, value_dim=16))  # values apart: not a latent cache
    with pytest.raises(ValueError, match=r"\[B, 1, R \+ r, R\]"):
        layer(torch.randn(2, 3, 32), cache=layer.new_cache(1, 8))
