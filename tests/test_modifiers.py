"""Score modifiers (sinks, ALiBi, dense and relative biases, score_mod) on every kernel that takes them, against
the float64 oracle of tests/modifier_oracle.py: prefill, chunked prefill, decode, ragged per-row positions,
windows, rows that see nothing, bidirectional; forward and backward; NaN in masked K/V."""

from __future__ import annotations

import math

import pytest
import torch

from engine import causal_attention, explain, key_padding_mask, padding_mask, padding_positions, window_mask
from engine.kernels.decode.native_build import native_unavailable
from engine.relative_bias import RelativePositionBias
from tests.modifier_oracle import oracle

B, HQ, HKV, D = 2, 4, 2, 8
KERNELS = ["reference", "tiled", "sdpa_tiles"]  # forced; one that does not take a modifier falls back (exact)


def bucket_of(relative: int, num_buckets: int, bidirectional: bool, max_distance: int) -> int:
    """T5's bucket of ``key_pos - query_pos``, from its definition, one Python number at a time."""
    per_side = num_buckets // 2 if bidirectional else num_buckets
    offset = per_side if bidirectional and relative > 0 else 0
    distance = abs(relative) if bidirectional else max(-relative, 0)
    exact = per_side // 2
    if distance < exact:
        return offset + distance
    far = exact + int(math.log(distance / exact) / math.log(max_distance / exact) * (per_side - exact))
    return offset + min(far, per_side - 1)


def dense_relative(table, qpos, kpos, bidirectional, max_distance):
    """``[B, Hq, T, S]`` bias of a bucket table, one (row, query, key) at a time."""
    b, t, s = qpos.shape[0], qpos.shape[1], kpos.shape[1]
    idx = torch.tensor([[[bucket_of(int(kpos[r, j] - qpos[r, i]), table.shape[1], bidirectional, max_distance)
                          for j in range(s)] for i in range(t)] for r in range(b)])  # [B, T, S]
    return table[:, idx].transpose(0, 1)  # [B, Hq, T, S]


def score_mod(score, batch, head, query_pos, key_pos):
    """A modifier no other form expresses: per-head tanh cap, a per-row shift and a distance term."""
    return 3.0 * torch.tanh(score / (2.0 + head)) + 0.3 * batch - 0.05 * (query_pos - key_pos).abs()


def modifiers(name: str, t: int, s: int, g: torch.Generator, qpos, kpos, causal: bool):
    """``(engine keywords, oracle keywords)`` for one modifier family."""
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    if name == "sinks":
        sinks = rand(HQ)
        return dict(sinks=sinks), dict(sinks=sinks)
    if name == "alibi":
        slopes = torch.rand(HQ, generator=g, dtype=torch.float64)
        return dict(alibi_slopes=slopes), dict(alibi=slopes)
    if name == "alibi_per_row":
        slopes = torch.rand(B, HQ, generator=g, dtype=torch.float64)
        return dict(alibi_slopes=slopes), dict(alibi=slopes)
    if name == "bias":
        bias = rand(B, HQ, t, s)
        return dict(bias=bias), dict(bias=bias)
    if name == "bias_broadcast":  # one row of the batch, shared by every query
        bias = rand(1, HQ, 1, s)
        return dict(bias=bias), dict(bias=bias)
    if name == "relative":
        bidirectional = not causal
        table = rand(HQ, 16)
        dense = dense_relative(table, qpos, kpos, bidirectional, max_distance=40)
        return dict(bias=RelativePositionBias(table, bidirectional, 40)), dict(bias=dense)
    if name == "score_mod":
        return dict(score_mod=score_mod), dict(score_mod=score_mod)
    if name == "everything":  # all at once, with a softcap before them
        slopes, sinks, bias = torch.rand(HQ, generator=g, dtype=torch.float64), rand(HQ), rand(1, HQ, t, s)
        return (dict(sinks=sinks, alibi_slopes=slopes, bias=bias, score_mod=score_mod, softcap=5.0),
                dict(sinks=sinks, alibi=slopes, bias=bias, score_mod=score_mod, softcap=5.0))
    raise AssertionError(name)


MODIFIERS = ["sinks", "alibi", "alibi_per_row", "bias", "bias_broadcast", "relative", "score_mod", "everything"]


def scenario(name: str):
    """``(t, s, query_positions [B, T], key_positions [B, S], allowed, causal)``."""
    if name == "prefill":
        t = s = 37
    elif name == "chunked":  # queries 31..39 against keys 0..39
        t, s = 9, 40
    elif name == "decode":  # one query against a cache long enough for the decode kernel
        t, s = 1, 600
    elif name == "empty_rows":  # T > S: the first 4 queries sit at negative positions and see nothing
        t, s = 12, 8
    elif name == "bidirectional":
        t, s = 7, 20
    elif name in ("ragged", "window"):
        t = s = 21
    elif name == "decode_padded":  # one query per row, row 1 left-padded by 100 keys
        t, s = 1, 600
    else:
        raise AssertionError(name)
    qpos, kpos = torch.arange(s - t, s).expand(B, t), torch.arange(s).expand(B, s)
    allowed, causal = None, name != "bidirectional"
    if name == "ragged":  # row 1 left-padded by 6: its real tokens still sit at positions 0..14
        lengths = torch.tensor([21, 15])
        qpos = kpos = padding_positions(lengths, 21, side="left")  # [B, 21]
        allowed = padding_mask(lengths, 21, side="left")  # pad queries see nothing, nobody sees pad keys
    if name == "decode_padded":
        lengths = torch.tensor([600, 500])
        kpos = padding_positions(lengths, 600, side="left")  # [B, 600]
        qpos = kpos[:, -1:]
        allowed = key_padding_mask(lengths, 600, side="left")
    if name == "window":
        allowed = window_mask(qpos[0], kpos[0], 5)
    return t, s, qpos, kpos, allowed, causal


SCENARIOS = ["prefill", "chunked", "decode", "empty_rows", "bidirectional", "ragged", "window"]


def qkv(t, s, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, n, D, generator=g, dtype=dtype) for h, n in ((HQ, t), (HKV, s), (HKV, s)))


@pytest.mark.parametrize("kernel", [*KERNELS, "decode"])  # decode runs T <= 16 (the other scenarios fall back)
@pytest.mark.parametrize("where", SCENARIOS)
@pytest.mark.parametrize("name", MODIFIERS)
def test_each_modifier_matches_the_float64_oracle(name, where, kernel):
    t, s, qpos, kpos, allowed, causal = scenario(where)
    q, k, v = qkv(t, s)
    ours, theirs = modifiers(name, t, s, torch.Generator().manual_seed(1), qpos, kpos, causal)
    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, causal=causal, kernel=kernel, return_lse=True, **ours)
    want, want_lse = oracle(q, k, v, qpos, kpos, allowed, causal=causal, **theirs)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, rtol=1e-9, atol=1e-9)
    if where == "empty_rows":  # rows that see no key: output 0 (lse -inf, or the sink's own logit)
        assert bool((out[:, :, :4] == 0).all())
        if "sinks" in ours:
            torch.testing.assert_close(lse[:, :, :4], ours["sinks"][None, :, None].expand(B, HQ, 4))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("where", ["chunked", "ragged", "empty_rows", "window"])
@pytest.mark.parametrize("name", MODIFIERS)
def test_gradients_match_the_oracle_through_out_and_lse(name, where, kernel):
    t, s, qpos, kpos, allowed, causal = scenario(where)
    q, k, v = (x.requires_grad_() for x in qkv(t, s, seed=2))
    ours, theirs = modifiers(name, t, s, torch.Generator().manual_seed(3), qpos, kpos, causal)
    learned = [x for key, x in ours.items() if key in ("sinks", "bias") and isinstance(x, torch.Tensor)]
    for x in learned:
        x.requires_grad_()
    if isinstance(ours.get("bias"), RelativePositionBias):  # a learned T5 table: its gradient is a scatter-add
        table = ours["bias"].table.requires_grad_()
        theirs["bias"] = dense_relative(table, qpos, kpos, not causal, max_distance=40)
        learned.append(table)
    g = torch.Generator().manual_seed(4)
    w_out, w_lse = torch.randn(B, HQ, t, D, generator=g, dtype=torch.float64), torch.randn(B, HQ, t, generator=g,
                                                                                         dtype=torch.float64)

    def loss(out, lse):
        return (out * w_out).sum() + torch.where(torch.isfinite(lse), lse * w_lse, 0.0).sum()

    out, lse = causal_attention(q, k, v, qpos, kpos, allowed, causal=causal, kernel=kernel, return_lse=True, **ours)
    ours_grads = torch.autograd.grad(loss(out, lse), [q, k, v, *learned])
    want_grads = torch.autograd.grad(loss(*oracle(q, k, v, qpos, kpos, allowed, causal=causal, **theirs)),
                                     [q, k, v, *learned])
    for got, want in zip(ours_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kernel", [*KERNELS, "decode"])
@pytest.mark.parametrize("where", ["ragged", "decode_padded"])
@pytest.mark.parametrize("name", MODIFIERS)
def test_nan_and_inf_in_masked_keys_and_values_do_not_leak(name, where, kernel):
    t, s, qpos, kpos, allowed, causal = scenario(where)  # row 1's first keys are padding: nobody sees them
    pad = 6 if where == "ragged" else 100
    q, k, v = qkv(t, s, seed=5)
    ours, theirs = modifiers(name, t, s, torch.Generator().manual_seed(6), qpos, kpos, causal)
    want, want_lse = oracle(q, k, v, qpos, kpos, allowed, causal=causal, **theirs)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, :pad, 0], v_bad[1, :, :pad, 1] = float("nan"), float("inf")
    leaves = [x.requires_grad_(kernel != "decode") for x in (q.clone(), k_bad, v_bad)]
    out, lse = causal_attention(*leaves, qpos, kpos, allowed, causal=causal, kernel=kernel, return_lse=True, **ours)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)  # pad queries (ragged) see nothing: 0 in both
    if kernel != "decode":
        out.sum().backward()
        assert all(bool(torch.isfinite(x.grad).all()) for x in leaves)


def test_relative_buckets_equal_t5s_own():
    """The structured bias's buckets against transformers' T5 (the model family it is for)."""
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = torch.arange(-300, 301)
    for bidirectional in (True, False):
        for num_buckets, max_distance in ((32, 128), (16, 40), (8, 20)):
            bias = RelativePositionBias(torch.zeros(1, num_buckets), bidirectional, max_distance)
            want = t5.T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
            assert torch.equal(bias.buckets(relative), want.long()), (bidirectional, num_buckets, max_distance)
            ours = torch.tensor([bucket_of(int(r), num_buckets, bidirectional, max_distance) for r in relative])
            assert torch.equal(bias.buckets(relative), ours)


def test_alibi_without_the_causal_rule_is_flash_attns_convention():
    """flash-attn (causal=False): bias ``-slope * |i + S - T - j|`` for query index i, key index j; the engine's
    ``-slope * |key_pos - query_pos|`` with default positions (queries at S-T .. S-1) is the same number."""
    t, s = 5, 11
    q, k, v = qkv(t, s, seed=7)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    i, j = torch.arange(t)[:, None], torch.arange(s)[None, :]
    flash_bias = -slopes[:, None, None] * (i + s - t - j).abs().double()  # [Hq, T, S]
    want, _ = oracle(q, k, v, causal=False, bias=flash_bias)
    for kernel in KERNELS:
        out = causal_attention(q, k, v, causal=False, alibi_slopes=slopes, kernel=kernel)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    # causal: flash-attn's bias on the visible keys (j <= i + S - T) is slope * (j - i - S + T), the engine's
    # slope * (key_pos - query_pos)
    causal_bias = (slopes[:, None, None] * (j - i - s + t).double()).masked_fill(j > i + s - t, 0.0)
    want, _ = oracle(q, k, v, bias=causal_bias)
    torch.testing.assert_close(causal_attention(q, k, v, alibi_slopes=slopes), want, rtol=1e-10, atol=1e-10)


def test_alibi_in_chunks_and_decode_equals_one_prefill():
    """Positions carry ALiBi: a prefill split into chunks, and a decode step, need no offsets."""
    t = 40
    q, k, v = qkv(t, t, seed=8)
    slopes = torch.rand(HQ, dtype=torch.float64)
    full = causal_attention(q, k, v, alibi_slopes=slopes)
    chunks = [causal_attention(q[:, :, a:a + 13], k[:, :, :a + 13], v[:, :, :a + 13], alibi_slopes=slopes)
              for a in range(0, t, 13)]
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, rtol=1e-12, atol=1e-12)
    last = causal_attention(q[:, :, -1:], k, v, alibi_slopes=slopes)  # decode: query at position 39
    torch.testing.assert_close(last, full[:, :, -1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_alibi_is_as_accurate_as_the_tiled_kernel_in_low_precision(dtype):
    """ALiBi at distances of thousands: the fused kernel adds it in fp32 (a bf16 bias would be off by units)."""
    t, s = 64, 2048
    q, k, v = qkv(t, s, seed=9, dtype=dtype)
    slopes = torch.full((HQ,), 0.75, dtype=torch.float32)
    want, _ = oracle(q, k, v, alibi=slopes.double())
    fused = causal_attention(q, k, v, alibi_slopes=slopes, kernel="sdpa_tiles")
    tiled = causal_attention(q, k, v, alibi_slopes=slopes, kernel="tiled")
    err_fused, err_tiled = ((x.double() - want).abs().max().item() for x in (fused, tiled))
    assert err_fused <= 2 * err_tiled + 4 * torch.finfo(dtype).eps, (err_fused, err_tiled)


def test_explain_names_the_kernel_of_each_modifier():
    q, k, v = qkv(300, 300)
    slopes, sinks = torch.rand(HQ), torch.randn(HQ)
    q, k, v = q.float(), k.float(), v.float()
    choice = explain(q, k, v, alibi_slopes=slopes)
    assert choice.kernel == "sdpa_tiles" and "alibi: computed by sdpa_tiles" in str(choice)
    assert "alibi: not computed by this kernel" in choice.passed_over["sdpa"]
    choice = explain(q, k, v, score_mod=score_mod, sinks=sinks)
    assert choice.kernel == "tiled" and "score_mod: computed by tiled" in str(choice)
    assert "sinks: applied to tiled's out and lse after it runs" in str(choice)
    assert explain(q, k, v, sinks=sinks).kernel == "sdpa"  # sinks need no kernel of their own
    decode = explain(q[:, :, -1:], torch.randn(B, HKV, 1024, D), torch.randn(B, HKV, 1024, D), alibi_slopes=slopes)
    native = native_unavailable() is None  # (the native kernel adds ALiBi in C++; without it the torch decode does)
    assert decode.kernel == ("decode_native" if native else "decode"), decode
    assert f"alibi: computed by {decode.kernel}" in str(decode)
    dense_bias = torch.randn(1, HQ, 300, 300, requires_grad=True)
    assert explain(q, k, v, bias=dense_bias).kernel == "tiled"  # the fused backward gives no bias gradient
    assert explain(q, k, v, bias=dense_bias.detach()).kernel == "sdpa_tiles"
    with torch.no_grad():  # no gradient wanted: the fused kernel again
        assert explain(q, k, v, bias=dense_bias).kernel == "sdpa_tiles"


BAD = [
    (dict(sinks=torch.zeros(3)), "sinks must have shape [Hq] = [4]"),
    (dict(sinks=torch.zeros(4, dtype=torch.long)), "sinks must be a floating-point tensor, got a torch.int64"),
    (dict(sinks=torch.tensor([0.0, float("-inf"), 0.0, 0.0])), "sinks must be finite"),
    (dict(sinks=[0.0] * 4), "sinks must be a floating-point tensor, got list"),
    (dict(alibi_slopes=torch.zeros(2, 2)), "alibi_slopes must have shape [Hq] = [4] or [B, Hq] = [2, 4]"),
    (dict(alibi_slopes=torch.zeros(4, requires_grad=True)), "alibi_slopes requires grad"),
    (dict(alibi_slopes=torch.tensor([1.0, float("nan"), 0, 0])), "alibi_slopes must be finite"),
    (dict(bias=torch.zeros(3, 4, 6, 6)), "bias must be a float tensor broadcastable to [B, Hq, T, S] = [2, 4, 6, 6]"),
    (dict(bias=torch.zeros(1, 1, 1, 1, 1)), "bias must be a float tensor broadcastable"),
    (dict(bias=torch.full((6, 6), float("-inf"))), "hide keys with allowed, not with a -inf bias"),
    (dict(bias=torch.zeros(6, 6, dtype=torch.bool)), "bias must be a floating-point tensor, got a torch.bool"),
    (dict(bias=RelativePositionBias(torch.zeros(3, 8))), "a RelativePositionBias table must be [Hq, num_buckets]"),
    (dict(bias=RelativePositionBias(torch.zeros(4, 32), max_distance=8)), "max_distance must be an int > 8"),
    (dict(bias=RelativePositionBias(torch.zeros(4, 2))), "must be [Hq, num_buckets] = [4, >= 4] (bidirectional"),
    (dict(bias=RelativePositionBias(torch.zeros(4, 3), max_distance=64)), "must be [Hq, num_buckets] = [4, >= 4]"),
    (dict(bias=RelativePositionBias(torch.zeros(4, 1), False)), "must be [Hq, num_buckets] = [4, >= 2]"),
    (dict(bias=RelativePositionBias(torch.zeros(4, 8), bidirectional=1)), "bidirectional must be a bool, got 1"),
    (dict(score_mod="tanh"), "score_mod must be a callable"),
    (dict(dropout_p=1.0), "dropout_p must be a number in [0, 1), got 1.0"),
    (dict(dropout_p=-0.1), "dropout_p must be a number in [0, 1)"),
    (dict(dropout_p=True), "dropout_p must be a number in [0, 1), got True"),
    (dict(dropout_p=0.1, generator=1), "generator must be a torch.Generator or None, got int"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_modifiers_raise_value_errors_naming_what_was_expected(bad, message):
    q, k, v = (x.float() for x in qkv(6, 6))
    with pytest.raises(ValueError) as error:
        causal_attention(q, k, v, **bad)
    assert message in str(error.value)
    with pytest.raises(ValueError):  # explain validates the same way
        explain(q, k, v, **bad)


@pytest.mark.parametrize("returned, message", [(lambda s, b, h, i, j: s[..., :1, :1, :1], None),
                                               (lambda s, b, h, i, j: s.sum(-1), "broadcastable to the scores"),
                                               (lambda s, b, h, i, j: 1.0, "must return a float tensor"),
                                               (lambda s, b, h, i, j: (i - j), "must return a float tensor")])
def test_score_mod_must_return_scores_of_their_shape(returned, message):
    q, k, v = (x.float() for x in qkv(6, 6))
    if message is None:  # broadcasting a smaller tensor is fine
        causal_attention(q, k, v, score_mod=returned)
        return
    for kernel in ("tiled", "reference"):
        with pytest.raises(ValueError, match=message):
            causal_attention(q, k, v, score_mod=returned, kernel=kernel)


# --- learned biases: a gradient on every kernel, or a clear refusal; never a dropped one -------------------------


@pytest.mark.parametrize("kernel", ["auto", "decode", "decode_native", "sdpa_tiles", "tiled", "reference"])
@pytest.mark.parametrize("q_grad", [True, False], ids=["q_grad", "table_only"])
@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_learned_relative_bias_table_gets_the_oracles_gradient_on_every_kernel(where, q_grad, kernel):
    # T5 training: the table requires grad. A kernel that cannot give it its gradient does not fit the call
    # (the option "bias_grad"), so every kernel name ends in one that does; before, fast kernels dropped it
    t, s = (20, 20) if where == "prefill" else (1, 600)
    q, k, v = qkv(t, s, seed=7)
    q.requires_grad_(q_grad)
    table = torch.randn(HQ, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64, requires_grad=True)
    bias = RelativePositionBias(table, False, 64)
    assert explain(q, k, v, bias=bias, kernel=kernel).kernel in ("tiled", "reference")
    out = causal_attention(q, k, v, bias=bias, kernel=kernel)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    qpos, kpos = torch.arange(s - t, s).expand(B, t), torch.arange(s).expand(B, s)
    want = oracle(q, k, v, bias=dense_relative(table, qpos, kpos, False, 64))[0]
    wanted = [table, q] if q_grad else [table]
    got, expected = torch.autograd.grad((out * w).sum(), wanted), torch.autograd.grad((want * w).sum(), wanted)
    for ours_grad, oracle_grad in zip(got, expected):
        torch.testing.assert_close(ours_grad, oracle_grad, rtol=1e-8, atol=1e-8)
    with torch.no_grad():  # no gradient wanted: the fast kernels take the table again
        assert explain(q, k, v, bias=bias).kernel in ("sdpa_tiles", "decode")
        torch.testing.assert_close(causal_attention(q, k, v, bias=bias), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kernel", ["auto", "tiled", "reference"])
def test_a_dense_bias_that_requires_grad_gets_its_gradient_with_q_frozen(kernel):
    q, k, v = qkv(9, 40, seed=10)
    bias = torch.randn(1, HQ, 9, 40, generator=torch.Generator().manual_seed(11), dtype=torch.float64,
                       requires_grad=True)
    got = torch.autograd.grad(causal_attention(q, k, v, bias=bias, kernel=kernel).sum(), bias)[0]
    want = torch.autograd.grad(oracle(q, k, v, bias=bias)[0].sum(), bias)[0]
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("kernel", ["auto", "tiled", "reference"])
@pytest.mark.parametrize("q_grad", [True, False], ids=["q_grad", "q_frozen"])
def test_a_score_mod_that_captures_a_tensor_requiring_grad_is_refused_on_every_kernel(q_grad, kernel):
    # no kernel computes a captured tensor's gradient: one clear error everywhere (before: the reference gave a
    # gradient, the tiled kernels crashed inside autograd); under no_grad nothing is differentiated and it runs
    q, k, v = qkv(20, 20, seed=12)
    q.requires_grad_(q_grad)
    shift = torch.randn(HQ, dtype=torch.float64, requires_grad=True)
    mod = lambda s, b, h, i, j: s + shift[h] * (i - j)  # noqa: E731
    with pytest.raises(ValueError, match="score_mod captures a tensor that requires grad"):
        causal_attention(q, k, v, score_mod=mod, kernel=kernel)
    with pytest.raises(ValueError, match="score_mod captures a tensor that requires grad"):
        explain(q, k, v, score_mod=mod, kernel=kernel)
    with torch.no_grad():
        torch.testing.assert_close(causal_attention(q, k, v, score_mod=mod, kernel=kernel),
                                   oracle(q, k, v, score_mod=mod)[0], rtol=1e-9, atol=1e-9)
    frozen = lambda s, b, h, i, j: s + shift.detach()[h] * (i - j)  # noqa: E731
    torch.testing.assert_close(causal_attention(q, k, v, score_mod=frozen, kernel=kernel),
                               oracle(q, k, v, score_mod=frozen)[0], rtol=1e-9, atol=1e-9)
