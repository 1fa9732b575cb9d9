"""The lab's measuring tools: the traffic counter, the decode probe, power-law fits, peak allocation."""

from __future__ import annotations

import pytest
import torch

from engine.attention import causal_attention
from lab.fitting import fit_power_law, solve_power_law
from lab.implementations import grouped_decode, select, torch_sdpa
from lab.measure import peak_allocated_bytes
from lab.traffic import TrafficCounter, distinct_bytes


def test_traffic_counter_counts_one_matmul_exactly():
    a, b = torch.randn(4, 8), torch.randn(8, 16)  # [4, 8] @ [8, 16]
    with TrafficCounter(inputs=(a, b)) as traffic:
        a @ b
    assert traffic.flops == 2 * 4 * 8 * 16
    assert traffic.input_bytes_read == (4 * 8 + 8 * 16) * 4
    assert traffic.other_bytes_read == 0
    assert traffic.bytes_written == 4 * 16 * 4


def test_traffic_counter_sees_copies_made_on_the_way():
    k = torch.randn(1, 2, 16, 4)  # [B, Hkv, S, D]
    with TrafficCounter(inputs=(k,)) as traffic:
        copy = k.repeat_interleave(4, dim=1)  # [B, 8, S, D]: a real copy
        copy.sum()
    assert traffic.input_bytes_read == k.numel() * 4
    assert traffic.other_bytes_read >= copy.numel() * 4  # the sum reads the 4x larger copy
    assert traffic.flops == 0


def test_distinct_bytes_counts_a_broadcast_once():
    x = torch.randn(1, 5)
    assert distinct_bytes(x.expand(1000, 5)) == 5 * 4
    assert distinct_bytes(torch.empty(0)) == 0


# (Hq, Hkv): MHA, GQA, MQA
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_grouped_decode_equals_causal_attention(q_heads, kv_heads):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, q_heads, 1, 16, generator=generator, dtype=torch.float64)  # [B, Hq, 1, D]
    k = torch.randn(2, kv_heads, 37, 16, generator=generator, dtype=torch.float64)  # [B, Hkv, S, D]
    v = torch.randn(2, kv_heads, 37, 8, generator=generator, dtype=torch.float64)  # [B, Hkv, S, Dv]
    expected = causal_attention(q, k, v, kernel="reference")
    torch.testing.assert_close(grouped_decode(q, k, v), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t, s", [(1, 29), (17, 17)])  # decode, prefill: the shapes the peer is used for
def test_torch_sdpa_peer_follows_the_engine_rule(t, s):
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, t, 8, generator=generator, dtype=torch.float64)  # [B, Hq, T, D]
    k = torch.randn(1, 2, s, 8, generator=generator, dtype=torch.float64)  # [B, Hkv, S, D]
    v = torch.randn(1, 2, s, 8, generator=generator, dtype=torch.float64)  # [B, Hkv, S, D]
    torch.testing.assert_close(torch_sdpa(q, k, v), causal_attention(q, k, v, kernel="reference"),
                               rtol=1e-10, atol=1e-10)


def test_torch_sdpa_peer_refuses_chunked_prefill():
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 9, 4)
    with pytest.raises(ValueError, match="prefill .* or decode"):
        torch_sdpa(q, k, k)


def test_select_names_unknown_implementations():
    with pytest.raises(ValueError, match="unknown implementation"):
        select("engine:reference,warp-drive")
    assert list(select("engine:reference")) == ["engine:reference"]


def test_fit_power_law_recovers_an_exact_law():
    xs = [128, 256, 512, 1024]
    exponent, coefficient = fit_power_law(xs, [3.0 * x**2 for x in xs])
    assert exponent == pytest.approx(2.0) and coefficient == pytest.approx(3.0)
    assert solve_power_law(2.0, 3.0, 3.0 * 4096**2) == pytest.approx(4096)
    with pytest.raises(ValueError, match="two or more"):
        fit_power_law([5], [1.0])


def test_peak_allocated_bytes_sees_a_temporary_that_is_already_freed():
    def make_and_drop() -> float:
        big = torch.ones(2**20)  # 4 MiB, freed before returning
        return float(big[0])

    assert peak_allocated_bytes(make_and_drop) >= 4 * 2**20
