"""Batch invariance (issue 26): a request's decode output is bitwise the same whatever else shares its batch, whether
its keys are contiguous or paged (pages of 1, 16, 256 in any placement), with 1 or 2 threads; in batch-invariant
mode (engine.set_batch_invariant) a prefill's too, chunked or whole.

The native decode kernel cuts each sequence's keys into work items at fixed multiples of its SPLIT positions and
merges them in order, so a row's result depends on its own keys alone. (The model's matrix products are not
covered: see docs/CONVENTIONS.md.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

import engine
from engine import plan_paged
from engine.kernels.decode.native_build import native_unavailable
from engine.quantized import quantize

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))

HQ, HKV, D = 8, 2, 32
PAD = 1 << 40  # a padded slot's key position: never seen


@contextlib.contextmanager
def threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def requests(lengths, dtype, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(h, n, d, generator=g).to(dtype) for h, n in ((HQ, 1), (HKV, s), (HKV, s)))
            for s in lengths]


def contiguous(batch, window=None):
    """Each request's output ``[Hq, D]`` from one contiguous call over the padded batch (right padding)."""
    longest = max(k.shape[1] for _, k, _ in batch)
    q = torch.stack([q for q, _, _ in batch])  # [B, Hq, 1, D]
    k, v = (torch.stack([torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[1])) for x in xs])
            for xs in ([k for _, k, _ in batch], [v for _, _, v in batch]))  # [B, Hkv, S, D]
    lengths = torch.tensor([x.shape[1] for _, x, _ in batch])
    slots = torch.arange(longest)
    kpos = torch.where(slots < lengths[:, None], slots, PAD)  # [B, S]
    qpos = (lengths - 1)[:, None]  # [B, 1]
    allowed = None if window is None else engine.window_mask(qpos, kpos, window)
    plain = window is None and bool((lengths == longest).all())
    step = engine.plan(q, k, v) if plain else engine.plan(q, k, v, qpos, kpos, allowed)
    assert step.kernel == "decode_native", str(step)
    return list(step.run(q, k, v)[:, :, 0])


def paged(batch, page_size, quantized=False, window=None, seed=0, head_major=False):
    """Each request's output ``[Hq, D]`` from one paged call, its pages shuffled through one pool: ``[num_pages,
    page_size, Hkv, D]`` in memory (NHD), or with ``head_major`` ``[num_pages, Hkv, page_size, D]`` as PagedKVCache
    holds it (the kernel reads a page's two heads of a pair in turn: engine/kernels/decode/decode_native.cpp,
    heads_in_turn). ``quantized``: True for an int8 pool, or the quantized dtype."""
    g = torch.Generator().manual_seed(seed + 1)
    owned = [-(-k.shape[1] // page_size) for _, k, _ in batch]
    order = torch.randperm(sum(owned) + 2, generator=g)
    heads, d = batch[0][1].shape[0], batch[0][1].shape[-1]
    pools = [torch.zeros(sum(owned) + 2, heads, page_size, d, dtype=batch[0][1].dtype).transpose(1, 2) if head_major
             else torch.zeros(sum(owned) + 2, page_size, heads, d, dtype=batch[0][1].dtype) for _ in "kv"]
    table = torch.zeros(len(batch), max(owned), dtype=torch.long)
    taken = 0
    for b, ((_, k, v), n) in enumerate(zip(batch, owned)):
        table[b, :n] = order[taken:taken + n]
        taken += n
        j = torch.arange(k.shape[1])  # key j at pool[table[b, j // P], j % P], every key of the request at once
        pools[0][table[b, j // page_size], j % page_size] = k.transpose(0, 1)
        pools[1][table[b, j // page_size], j % page_size] = v.transpose(0, 1)
    if quantized:
        kind = torch.int8 if quantized is True else quantized
        pools = [quantize(pool.permute(0, 2, 1, 3), kind) for pool in pools]  # per token and head, as stored
        pools = [type(pool)(pool.data.permute(0, 2, 1, 3), pool.scale.permute(0, 2, 1)) for pool in pools]
    q = torch.stack([q[:, 0] for q, _, _ in batch])  # [Nq = B, Hq, D]
    lengths = torch.tensor([k.shape[1] for _, k, _ in batch])
    step = plan_paged(q, *pools, table, lengths, torch.arange(len(batch) + 1), window=window)
    assert step.path == "native in place", str(step)
    return list(step.run(q, *pools))


def quantized_request(request):
    """A request whose keys and values are their int8 round trip (the numbers an int8 cache holds)."""
    q, k, v = request
    return q, *(quantize(x.permute(1, 0, 2)[None]).dequantize()[0].permute(1, 0, 2) for x in (k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 1300], ids=["full", "window"])  # the window spans an item's cut
def test_a_request_is_bitwise_the_same_alone_in_any_batch_contiguous_or_paged_on_any_threads(dtype, window):
    mine, *others = requests([3000, 40, 777, 5000, 2048], dtype)  # 3000 keys: two work items of the kernel
    compositions = [[mine], [mine] + others[:1], others[:2] + [mine], others[1:] + [mine] + others[:1]]
    alone = contiguous([mine], window)[0]
    for n in (1, 2):
        with threads(n):
            for batch in compositions:
                at = next(i for i, r in enumerate(batch) if r is mine)
                assert torch.equal(contiguous(batch, window)[at], alone)
                for page_size in (1, 16, 256):
                    assert torch.equal(paged(batch, page_size, window=window)[at], alone), (n, page_size, len(batch))
                assert torch.equal(paged(batch, 16, window=window, head_major=True)[at], alone), (n, len(batch))


def test_an_int8_request_is_bitwise_the_same_in_any_batch_and_page_size():
    mine, *others = requests([2600, 64, 2100], torch.float32, seed=3)
    alone = paged([mine], 16, quantized=True)[0]
    for n in (1, 2):
        with threads(n):
            for batch in ([mine] + others, others + [mine]):
                at = next(i for i, r in enumerate(batch) if r is mine)
                for page_size in (1, 16, 256):
                    assert torch.equal(paged(batch, page_size, quantized=True)[at], alone)
                assert torch.equal(paged(batch, 16, quantized=True, head_major=True)[at], alone)
    torch.testing.assert_close(alone, contiguous([quantized_request(mine)])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [3, 5], ids=str)
@pytest.mark.parametrize("head_major", [True, False], ids=["head_major", "nhd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kv_heads_read_in_turn_give_each_heads_own_result(kv_heads, head_major, dtype):
    # pages of 16: a head-major pool has its heads read two at a time (bf16 and fp16: four; a head count they do not
    # divide leaves a smaller group), an NHD pool all of them with their next rows asked for in address order; two
    # threads may cut between heads read together: every request is still bitwise its contiguous self
    g = torch.Generator().manual_seed(kv_heads)
    batch = [tuple(torch.randn(h, n, D, generator=g).to(dtype)
                   for h, n in ((kv_heads * 2, 1), (kv_heads, s), (kv_heads, s))) for s in (2500, 33, 4100)]
    for n in (1, 2):
        with threads(n):
            want = [contiguous([request])[0] for request in batch]
            got = paged(batch, 16, head_major=head_major)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), n


@pytest.mark.parametrize("length", [17, 18, 19, 2049, 3003], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_request_whose_last_block_is_ragged_is_the_same_beside_a_longer_one(length, dtype):
    # its last block of keys holds 1-3 keys past a multiple of 4: alone they are the block's end, beside a longer
    # request they sit before masked padding, read by the kernel's 4-key pass instead of its 1- or 2-key pass
    mine, longer = requests([length, length + 5], dtype, seed=length)
    alone = contiguous([mine])[0]
    for at, batch in ((0, [mine, longer]), (1, [longer, mine])):
        assert torch.equal(contiguous(batch)[at], alone)
        assert torch.equal(paged(batch, 16)[at], alone)


@pytest.fixture
def invariant_mode():
    previous = engine.set_batch_invariant(True)
    yield
    engine.set_batch_invariant(previous)


def prefill_chunks(q, k, v, chunk, window=None):
    """A prompt prefilled ``chunk`` queries at a time, each chunk against the keys so far (as a server runs it)."""
    s, outs = q.shape[2], []
    pos = torch.arange(s)
    for i0 in range(0, s, chunk):
        i1 = min(s, i0 + chunk)
        allowed = None if window is None else engine.window_mask(pos[i0:i1], pos[:i1], window)
        outs.append(engine.causal_attention(q[:, :, i0:i1], k[:, :, :i1], v[:, :, :i1], pos[i0:i1], pos[:i1], allowed))
    return torch.cat(outs, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 700], ids=["full", "window"])
def test_in_batch_invariant_mode_a_prefill_is_bitwise_the_same_chunked_or_whole_alone_or_batched(
        invariant_mode, dtype, window):
    g = torch.Generator().manual_seed(11)
    s = 1100
    q, k, v = (torch.randn(1, h, s, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    with threads(1):
        whole = prefill_chunks(q, k, v, s, window)
    with threads(2):
        assert torch.equal(prefill_chunks(q, k, v, s, window), whole)  # on any thread count
    assert "batch-invariant mode: decode_native" in str(engine.explain(q, k, v, torch.arange(s), torch.arange(s)))
    for chunk in (1, 16, 100, 513):
        assert torch.equal(prefill_chunks(q, k, v, chunk, window), whole), chunk
    # beside a longer prompt in one padded call: the same rows
    other = [torch.randn(1, h, s + 37, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)]
    pad = [torch.nn.functional.pad(x, (0, 0, 0, 37)) for x in (q, k, v)]
    both = [torch.cat([p, o]) for p, o in zip(pad, other)]  # [2, H, s + 37, D]
    slots = torch.arange(s + 37)
    kpos = torch.stack([torch.where(slots < s, slots, PAD), slots])
    allowed = None if window is None else engine.window_mask(kpos, kpos, window)
    batched = engine.causal_attention(*both, kpos, kpos, allowed)
    assert torch.equal(batched[:1, :, :s], whole)
    # and as one sequence of a paged mixed step (its keys gathered from pages of 16)
    table = torch.randperm(-(-s // 16) + 3, generator=g)[None, : -(-s // 16)]
    pools = [torch.zeros(table.max() + 1, 16, HKV, D, dtype=dtype) for _ in "kv"]
    for j in range(s):
        pools[0][table[0, j // 16], j % 16], pools[1][table[0, j // 16], j % 16] = k[0, :, j], v[0, :, j]
    out = engine.paged_attention(q[0].transpose(0, 1), *pools, table, torch.tensor([s]), torch.tensor([0, s]),
                                 window=window)
    assert torch.equal(out, whole[0].transpose(0, 1))


def test_batch_invariant_mode_stays_within_the_oracle_and_says_where_it_does_not_hold(invariant_mode):
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, h, 300, D, generator=g) for h in (HQ, HKV, HKV))
    want = engine.causal_attention(q.double(), k.double(), v.double(), kernel="reference")
    torch.testing.assert_close(engine.causal_attention(q, k, v).double(), want, rtol=1e-5, atol=1e-5)
    assert engine.explain(q, k, v).kernel == "decode_native"
    text = str(engine.explain(q.requires_grad_(), k, v))
    assert "NOT batch-invariant, decode_native does not run it (gradients are needed" in text
    with pytest.raises(ValueError, match="True or False"):
        engine.set_batch_invariant("yes")


def test_a_plan_made_in_one_mode_is_not_reused_in_the_other():
    q, k, v = (torch.randn(1, h, 64, D) for h in (HQ, HKV, HKV))
    plain = engine.causal_attention(q, k, v)
    previous = engine.set_batch_invariant(True)
    try:
        fresh = engine.plan(q, k, v)  # (engine.plan never looks in the plain-call cache)
        assert fresh.kernel == "decode_native"
        invariant = engine.causal_attention(q, k, v)  # a cached plain-call plan of the other mode is not found
        assert torch.equal(invariant, fresh.run(q, k, v)) and not torch.equal(invariant, plain)
    finally:
        engine.set_batch_invariant(previous)
    assert engine.explain(q, k, v).kernel != "decode_native"
    torch.testing.assert_close(invariant, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(engine.causal_attention(q, k, v), plain)
