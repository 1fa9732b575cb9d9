"""The oracles agree with the seeds and with each other, independently of causal_attention."""

from __future__ import annotations

import torch

from engine.attention import causal_attention
from engine.reference import lists
from engine.reference.loops import per_query_attention, seed_loop_attention

# Seed 002, "Run it with python3 attention.py", verbatim.
SEED_002_OUTPUT = """\
causal attention weights (row = query position)
   1.00  0.00  0.00  0.00  0.00   sum=1.000
   0.40  0.60  0.00  0.00  0.00   sum=1.000
   0.21  0.07  0.72  0.00  0.00   sum=1.000
   0.11  0.10  0.67  0.11  0.00   sum=1.000
   0.19  0.14  0.25  0.22  0.19   sum=1.000
max change per position after editing token 4: 0.000 0.000 0.000 0.000 5.277
padding mask, 3 real tokens of 5, query 0: 0.40 0.13 0.47 0.00 0.00
naive softmax of [1000, 999, 0]: OverflowError: math range error
stable softmax:                  [0.7311, 0.2689, 0.0]
d_k=16    sd of q.k =   4.10  (sqrt(d_k) =  4.00); after scaling = 1.03
d_k=128   sd of q.k =  11.47  (sqrt(d_k) = 11.31); after scaling = 1.01
d_k=1024  sd of q.k =  31.77  (sqrt(d_k) = 32.00); after scaling = 0.99"""


def test_the_stdlib_program_prints_the_seed_output_digit_for_digit():
    assert "\n".join(lists.seed_program_lines()) == SEED_002_OUTPUT


def test_lists_softmax_zeros_a_fully_masked_row():
    assert lists.softmax([float("-inf")] * 3) == [0.0, 0.0, 0.0]


def test_seed_loop_listing_equals_causal_attention_with_gqa():
    t, s, hq, hkv, d = 3, 7, 4, 2, 5
    q, k, v = torch.randn(1, hq, t, d), torch.randn(1, hkv, s, d), torch.randn(1, hkv, s, d)
    flat = lambda x: x[0].transpose(0, 1).reshape(-1).tolist()  # [H, L, D] -> [L, H*D] row-major
    out = seed_loop_attention(flat(q), flat(k), flat(v), t, s, hq, hkv, d)
    out = torch.tensor(out).view(t, hq, d).transpose(0, 1)[None]  # [1, Hq, T, D]
    torch.testing.assert_close(out, causal_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_lists_attention_equals_the_per_query_loop():
    q, k, v = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 2)
    out, _ = lists.attention(q.tolist(), k.tolist(), v.tolist(), causal=True)
    loop = per_query_attention(q[None, None], k[None, None], v[None, None])[0, 0]
    torch.testing.assert_close(torch.tensor(out, dtype=torch.float64), loop)


def test_per_query_loop_with_softcap_and_positions():
    q, k, v = torch.randn(1, 1, 2, 4) * 5, torch.randn(1, 1, 3, 4) * 5, torch.randn(1, 1, 3, 4)
    qpos, kpos = torch.tensor([1, 2]), torch.arange(3)
    out = per_query_attention(q, k, v, qpos, kpos, softcap=2.0)
    scores = (q.double() @ k.double().transpose(-2, -1)) / 2.0
    scores = 2.0 * torch.tanh(scores / 2.0)
    scores[0, 0, 0, 2] = float("-inf")
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v.double())
