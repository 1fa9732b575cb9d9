"""engine.huge_pages.zeros: the KV caches' buffers (torch.zeros' contract, on 2 MiB pages where Linux gives them)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import huge_pages
from engine.kv_cache import KVCache
from engine.paged.pool import PagePool

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool, torch.long]
THP = huge_pages.mode() in ("always", "madvise")


def _smaps_of(address: int) -> dict[str, int]:
    """The numeric fields of /proc/self/smaps for the mapping holding ``address``."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside:
            name, _, value = line.partition(":")
            number = re.match(r"\s*(\d+)", value)
            if number:
                fields[name.strip()] = int(number.group(1))
    return fields


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), dtype=st.sampled_from(DTYPES),
       big=st.booleans())
def test_zeros_is_torch_zeros(shape, dtype, big):
    if big:  # 1-24 MiB: mostly past the 2 MiB threshold (the aligned, marked path)
        shape = [shape[0] % 3 + 1, (1 << 20) + shape[-1]]
    x = huge_pages.zeros(*shape, dtype=dtype)
    assert x.shape == torch.Size(shape) and x.dtype == dtype and x.device.type == "cpu" and x.is_contiguous()
    assert torch.equal(x, torch.zeros(*shape, dtype=dtype))
    # a view of its own buffer: writes land where they are read back, and nowhere else
    flat = x.view(-1)
    flat[-1] = 1
    assert int(x.view(-1)[-1]) == 1 and int(x.view(-1)[:-1].count_nonzero()) == 0


def test_other_devices_get_plain_zeros():
    x = huge_pages.zeros(4, 1 << 20, dtype=torch.float32, device="meta")
    assert x.device.type == "meta" and x.shape == (4, 1 << 20)


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {huge_pages.mode()} on this machine")
def test_big_buffers_start_a_stagger_past_a_huge_page_and_are_eligible():
    x = huge_pages.zeros(8, 4096, 128, dtype=torch.bfloat16)  # 8 MiB
    offset = x.data_ptr() % huge_pages.HUGE_PAGE
    assert offset % huge_pages.STAGGER == 0 and offset < huge_pages.COLOURS * huge_pages.STAGGER
    fields = _smaps_of(x.data_ptr())
    if "THPeligible" in fields:  # (kernels since 4.x report it)
        assert fields["THPeligible"] == 1, fields
    small = torch.zeros(8, 4096, 128, dtype=torch.bfloat16)  # the plain allocation, for contrast
    assert torch.equal(x, small)


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {huge_pages.mode()} on this machine")
def test_caches_use_huge_pages():
    cache = KVCache(1, 8, 4096, 128, dtype=torch.bfloat16)
    for buffer in (cache.keys, cache.values):
        assert buffer.data_ptr() % huge_pages.HUGE_PAGE % huge_pages.STAGGER == 0
    k, v = torch.randn(1, 8, 5, 128).bfloat16(), torch.randn(1, 8, 5, 128).bfloat16()
    keys, values, _, _ = cache.update(k, v)
    assert torch.equal(keys[:, :, -5:], k) and torch.equal(values[:, :, -5:], v)
    pool = PagePool(256, 16, 8, 128, 128, torch.float32, None)
    assert pool.keys.data_ptr() % huge_pages.HUGE_PAGE % huge_pages.STAGGER == 0
    assert pool.keys.shape == (256, 16, 8, 128) and not pool.keys.any()


@pytest.mark.skipif(not THP, reason=f"transparent huge pages are {huge_pages.mode()} on this machine")
def test_a_caches_keys_and_values_start_apart_from_each_other():
    """K and V a multiple of 2 MiB apart read 1.6x slower on a Zen 4 (the module's note): a cache's two buffers, and a
    pool's, start half a 4 KiB page apart, whatever came before them."""
    for _ in range(huge_pages.COLOURS + 1):  # every turn of the offsets, and past the wrap
        cache = KVCache(1, 2, 8192, 128, dtype=torch.bfloat16)  # 4 MiB each
        apart = cache.values.data_ptr() - cache.keys.data_ptr()
        assert apart % 4096 == 2048, apart
    pool = PagePool(64, 16, 8, 128, 128, torch.float32, None, layers=4)  # 4 MiB each
    for keys, values in zip(pool.layer_keys, pool.layer_values):
        assert (values.data_ptr() - keys.data_ptr()) % 4096 == 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_the_same_on_either_page_size(dtype):
    """A caller's rows (4 KiB pages) and a huge-page buffer's: the speed may differ, the values never (bitwise)."""
    from engine.kernels.decode.decode_native import native_unavailable
    if native_unavailable():
        pytest.skip(native_unavailable())
    from engine import plan
    torch.manual_seed(0)
    q = torch.randn(1, 8, 1, 64).to(dtype)
    k_plain, v_plain = torch.randn(1, 2, 9000, 64).to(dtype), torch.randn(1, 2, 9000, 64).to(dtype)
    k_huge, v_huge = (huge_pages.zeros(*x.shape, dtype=dtype).copy_(x) for x in (k_plain, v_plain))
    p = plan(q, k_plain, v_plain, kernel="decode_native")
    assert torch.equal(p.run(q, k_plain, v_plain), p.run(q, k_huge, v_huge))


def test_zeros_takes_a_size_like_torch_zeros_and_names_a_bad_shape():
    assert huge_pages.zeros(torch.Size([2, 3]), dtype=torch.float32).shape == (2, 3)
    assert huge_pages.zeros((4, 1 << 19), dtype=torch.float32).shape == (4, 1 << 19)  # 8 MiB: the huge-page path
    for bad in ((2, 3.0), (2, -1), (True, 2)):
        with pytest.raises(ValueError, match="shape of ints"):
            huge_pages.zeros(*bad, dtype=torch.float32)

