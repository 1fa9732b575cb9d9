"""run.py bench paged: its pools hold the keys where the page table says (on 2 MiB pages too), the decode group
compares the same keys every way, and the memory group counts slots."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import engine
from engine import PagedKVCache, paged_attention
from lab.bench import paged as bench_paged
from lab.bench import paged_placement
from lab.bench.paged_pools import PLACEMENTS, on_huge_pages, placement_table, quantized_pool


@pytest.mark.parametrize("quantized", [False, True])
def test_heads_outer_pools_hold_each_heads_pages_as_one_region_with_the_same_values(quantized):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 32, 8, generator=g)  # [B, Hkv, S, D]
    pool, _, _ = bench_paged.pools(k, k, 8, g, True, "in order")  # [num_pages 8, page_size 8, Hkv 3, D 8]
    if quantized:
        pool = quantized_pool(pool)
    for held, heads_outer in ((on_huge_pages(pool, heads_outer=True), True), (on_huge_pages(pool), False)):
        parts = [(held.data, pool.data), (held.scale, pool.scale)] if quantized else [(held, pool)]
        for x, want in parts:  # [num_pages, page_size, Hkv(, D)]
            assert torch.equal(x, want)
            row = x.stride(1)  # a slot's row
            if heads_outer:  # storage [Hkv, num_pages, page_size(, D)]: page p + 1 starts where page p's slots end
                assert (x.stride(0), x.stride(2)) == (8 * row, 8 * 8 * row)
            else:  # PagedKVCache(heads_outer=False)'s [num_pages, Hkv, page_size(, D)]
                assert (x.stride(0), x.stride(2)) == (3 * 8 * row, 8 * row)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_benchs_pools_hold_each_key_where_its_page_table_says(placement):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 32, 8, generator=g), torch.randn(2, 3, 32, 8, generator=g)  # [B, Hkv, S, D]
    for head_major in (True, False):
        k_pages, v_pages, table = bench_paged.pools(k, v, 8, g, head_major, placement)
        assert sorted(table.reshape(-1).tolist()) == list(range(8))  # every page once
        assert k_pages.shape == (8, 8, 3, 8)
        for b, j in ((0, 0), (1, 17), (1, 31)):
            assert torch.equal(k_pages[table[b, j // 8], j % 8], k[b, :, j]) and \
                torch.equal(v_pages[table[b, j // 8], j % 8], v[b, :, j])
        q = torch.randn(2, 6, 8, generator=g)
        out = paged_attention(q, k_pages, v_pages, table, torch.tensor([32, 32]), torch.arange(3))
        dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_the_memory_group_counts_paged_slots_against_the_contiguous_reservation(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_paged.add_arguments(parser)
    args = parser.parse_args(["--groups", "memory", "--out", str(tmp_path), "--quiet"])
    assert bench_paged.main(args) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "paged.json").read_text())["rows"]}
    paged, contiguous = rows["paged (page 16)"], rows["contiguous reservation"]
    assert paged["tokens"] == contiguous["tokens"] and paged["token slots"] - paged["tokens"] < 64 * 16
    assert contiguous["token slots"] > paged["token slots"]
    assert "contiguous reservation" in capsys.readouterr().out


def test_the_cascade_group_compares_one_prefix_pass_with_reading_it_per_sequence(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_paged, "HQ", 8)  # a smaller model: the group's logic, not its timing
    parser = argparse.ArgumentParser()
    bench_paged.add_arguments(parser)
    args = parser.parse_args(["--groups", "cascade", "--quick", "--out", str(tmp_path), "--quiet"])
    assert bench_paged.main(args) == 0
    rows = json.loads((tmp_path / "paged.json").read_text())["rows"]
    assert {(r["impl"], r["kv_heads"]) for r in rows} == {(impl, h) for impl in ("cascade", "per sequence")
                                                          for h in (bench_paged.HKV, 8)}
    assert all(r["max |diff|"] < 1e-5 for r in rows)  # the two ways compute the same attention
    assert all(r["met"] in ("yes", "no") for r in rows if r["impl"] == "cascade")


def quick_rows(tmp_path, groups: str) -> list[dict]:
    """The rows ``bench paged --groups <groups> --quick`` saves."""
    parser = argparse.ArgumentParser()
    bench_paged.add_arguments(parser)
    args = parser.parse_args(["--groups", groups, "--quick", "--out", str(tmp_path), "--quiet"])
    assert bench_paged.main(args) == 0
    return json.loads((tmp_path / "paged.json").read_text())["rows"]


def test_the_step_and_continuous_groups_time_the_planned_paths_against_contiguous(tmp_path):
    rows = quick_rows(tmp_path, "step,continuous")
    step = [r for r in rows if r["group"] == "step"]
    assert {r["impl"] for r in step} == {"contiguous plan.run", "paged plan.run", "paged_attention"}
    assert {r["kernel"] for r in step if r["impl"] != "contiguous plan.run"} <= {"native in place", "per sequence"}
    assert all(r["max |diff|"] < 2e-2 for r in step)  # (bf16 rows: one bf16 unit at the outputs' magnitude)
    continuous = [r for r in rows if r["group"] == "continuous"]
    assert {(r["impl"], r["threads"]) for r in continuous} == {(impl, t) for impl in (
        "contiguous plan.run", "continuous batching layer") for t in (1, 2)}
    assert all(r["max |diff|"] < 1e-5 for r in continuous)
    assert all(r["met"] in ("yes", "no") for r in rows if r["target"])


def test_the_mixed_group_times_a_step_planned_once_against_the_same_calls_contiguous(tmp_path):
    rows = quick_rows(tmp_path, "mixed")
    assert {r["impl"] for r in rows} == {"contiguous plan.run", "paged plan.run", "paged_attention"}
    assert {r["kernel"] for r in rows} == {"mixed"}  # the decodes in place as one call, each prefill chunk its own
    assert all(r["max |diff|"] < 1e-5 for r in rows)
    assert all(r["met"] in ("yes", "no") for r in rows if r["target"])


def test_the_invariant_group_times_both_modes_and_leaves_the_default_on(tmp_path):
    rows = quick_rows(tmp_path, "invariant")
    assert {(r["impl"], r["kernel"]) for r in rows if r["case"].startswith("prefill")} == {
        ("default", "sdpa"), ("batch-invariant", "decode_native")}
    assert all(r["max |diff|"] < 2e-2 for r in rows)
    assert not engine.is_batch_invariant()


def test_the_tree_group_times_a_tree_verify_against_a_decode_step_and_checks_its_output(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_paged, "HQ", 8)  # a smaller model: the group's logic, not its timing
    monkeypatch.setattr(bench_paged, "D", 16)
    monkeypatch.setattr(bench_paged, "TREE_KEYS", {"quick": (512,)})
    every = quick_rows(tmp_path, "tree")
    assert {r["dtype"] for r in every} == {"float32", "bfloat16"}
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 2e-2)):  # (bf16: its output's rounding)
        rows = {r["impl"]: r for r in every if r["dtype"] == dtype}
        assert set(rows) == {"decode (1 query)", "tree 16", "tree 64"}
        assert rows["tree 16"]["max |diff|"] < tolerance and rows["tree 64"]["max |diff|"] < tolerance  # = contiguous
        assert rows["tree 16"]["met"] in ("yes", "no") and rows["tree 16"]["target"] == "<= 1.5x"
        assert rows["decode (1 query)"]["time/decode"] == 1.0
    assert (tmp_path / "paged_tree.png").exists()


def test_on_huge_pages_copies_values_and_memory_order():
    from engine.quantized import quantize
    from lab.bench.paged_pools import on_huge_pages

    x = torch.randn(3, 4, 5, 6).permute(0, 2, 1, 3)  # [3, 5, 4, 6] viewing [3, 4, 5, 6] memory
    held = on_huge_pages(x)
    assert torch.equal(held, x) and held.stride() == x.stride()
    q = quantize(torch.randn(2, 3, 4, 8))
    held_q = on_huge_pages(q)
    assert torch.equal(held_q.data, q.data) and torch.equal(held_q.scale, q.scale)
    assert held_q.data.stride() == q.data.stride() and held_q.scale.stride() == q.scale.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_the_decode_group_rows_hold_the_same_keys_every_way(dtype, monkeypatch):
    # a small shape (the group's logic, not its timing): every layout gives the contiguous result bitwise, and the
    # held (2 MiB-page) paged row is measured against the held contiguous row
    for name, value in (("B", 2), ("HQ", 8), ("HKV", 2), ("D", 32)):
        monkeypatch.setattr(bench_paged, name, value)
    rows = {r["impl"]: r for r in bench_paged._decode_case(512, 16, dtype, torch.Generator().manual_seed(0), 1, 1)}
    assert list(rows) == ["contiguous", "paged", "paged NHD", "contiguous held", "paged held", "copy, runs in order",
                          "copy, page runs"]
    assert rows["paged"]["max |diff|"] == 0.0
    held = rows["paged held"]
    assert held["time/contiguous"] == pytest.approx(held["ms"] / rows["contiguous held"]["ms"])
    assert held["target"] == rows["paged"]["target"] == f"<= {bench_paged.TARGET}x" and held["met"] in ("yes", "no")
    assert rows["contiguous held"]["target"] is None
    runs = rows["copy, page runs"]  # over the same copy of the runs in address order
    assert runs["time/contiguous"] == pytest.approx(runs["ms"] / rows["copy, runs in order"]["ms"])
    assert runs["target"] is None and runs["met"] is None


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
def test_page_runs_visit_each_heads_pages_in_page_table_order(quantized):
    # the runs gathered in page_runs' order are the keys as the sequences hold them: [B, Hkv, S, D], bitwise
    from lab.bench.paged_pools import pools, quantized_pool
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 2, 64, 8, generator=g)  # [B, Hkv, S, D], pages of 16
    k_pages, _, table = pools(k, k, 16, g, True)
    if quantized:
        k_pages = quantized_pool(k_pages)
    runs, order = bench_paged.page_runs(k_pages, table)
    want = (k_pages.data if quantized else k_pages)  # [num_pages, page_size, Hkv, D]
    sequence = want[table].permute(0, 3, 1, 2, 4).reshape(3, 2, 64, 8)  # [B, Hkv, S, D] through the table
    assert torch.equal(runs[order].reshape(3, 2, 64, 8), sequence)
    if not quantized:
        assert torch.equal(sequence, k)


def test_a_fresh_paged_cache_gives_each_sequence_pages_that_follow_on_as_the_in_order_placement_does():
    # prompts prefilled one after another, and sequences growing a token at a time together: either way each
    # sequence's pages follow on (its next page is the one after its last), as in the "in order" placement; the
    # first-free order of a plain free list gave growing sequences the "interleaved" one
    batch, pages, size = 3, 4, 2
    for together in (False, True):
        cache = PagedKVCache(4 * batch * pages, size, 1, 4)
        seqs = [cache.add() for _ in range(batch)]
        if together:
            for _ in range(pages * size):
                cache.append(seqs, torch.randn(batch, 1, 4), torch.randn(batch, 1, 4), torch.arange(batch + 1))
        for seq in seqs if not together else []:
            cache.append([seq], torch.randn(pages * size, 1, 4), torch.randn(pages * size, 1, 4), torch.tensor([0, 8]))
        table = cache.tables(seqs)[0]
        assert torch.equal(table - table[:, :1], torch.arange(pages).expand(batch, pages))  # each a run of pages
        assert len(set(table.reshape(-1).tolist())) == batch * pages
    assert torch.equal(placement_table(batch, pages, "in order", torch.Generator())[:, 1:] - 1,
                       placement_table(batch, pages, "in order", torch.Generator())[:, :-1])
    with pytest.raises(ValueError, match="placement must be one of"):
        placement_table(batch, pages, "random", torch.Generator())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_the_placement_group_times_every_placement_cold_against_contiguous(dtype, monkeypatch):
    # a small shape (the group's logic, not its timing): every placement reads the contiguous result bitwise, and
    # every timed call comes after the caches were cleared
    for name, value in (("B", 2), ("HQ", 8), ("HKV", 2), ("D", 32)):
        monkeypatch.setattr(paged_placement, name, value)
    events = []  # "clear" and "run", in order
    monkeypatch.setattr(paged_placement, "evict_caches", lambda: events.append("clear"))
    real = paged_placement.plan_paged

    class Counted:  # (a planned step is frozen: wrapped)
        def __init__(self, *args, **kwargs):
            self.step = real(*args, **kwargs)

        def run(self, *args):
            events.append("run")
            return self.step.run(*args)
    monkeypatch.setattr(paged_placement, "plan_paged", Counted)
    rows = paged_placement._placement_case(512, dtype, torch.Generator().manual_seed(0), 2)
    assert [r["impl"] for r in rows] == ["contiguous"] + [f"{layout}, {p}" for p in PLACEMENTS
                                                          for layout in ("paged", "heads outer")]
    assert all(r["max |diff|"] == 0.0 for r in rows)
    assert rows[0]["time/contiguous"] == 1.0 and all(r["ms"] > 0 for r in rows)
    # the diff's six paged calls, then two rounds of the seven rows, each timed call right after a clearing (the
    # contiguous row's run is not counted here)
    assert events[:6] == ["run"] * 6 and events.count("clear") == 2 * len(rows) and events.count("run") == 6 + 2 * 6
    assert all(events[i - 1] == "clear" for i in range(6, len(events)) if events[i] == "run")


def test_the_churn_groups_allocators_serve_the_same_requests_each_page_held_once():
    from engine.paged.pool import PagePool
    from lab.bench.paged_churn import PAGE, FirstFree, pages_per_run, served_tables
    first_free = FirstFree(8)
    assert first_free.take((), 3) == [0, 1, 2]  # the lowest ids first, a freed page next
    first_free.drop(1)
    assert first_free.take([5]) == [1]
    tables = [served_tables(allocator, 256, 120, 0.9, 3) for allocator in (FirstFree(256), PagePool(
        256, PAGE, 1, 1, 1, torch.float32, None))]
    (table, lens), (follows, follows_lens) = tables
    assert torch.equal(lens, follows_lens) and lens.shape[0] > 1  # the same requests, running
    for t in (table, follows):
        ids = [page for row, n in zip(t.tolist(), lens.tolist()) for page in row[:-(-n // PAGE)]]
        assert len(ids) == len(set(ids)) and 0 <= min(ids) and max(ids) < 256  # each page held by one sequence
    assert pages_per_run(follows, lens) > pages_per_run(table, lens)
    assert pages_per_run(torch.tensor([[4, 5, 9, 0]]), torch.tensor([3 * PAGE])) == 1.5  # runs [4, 5], [9]


def test_the_churn_group_reads_each_table_bitwise_the_same_in_both_layouts(monkeypatch):
    from lab.bench import paged_churn
    for name, value in (("HQ", 8), ("HKV", 2), ("D", 32)):
        monkeypatch.setattr(paged_churn, name, value)
    monkeypatch.setattr(paged_churn, "evict_caches", lambda: None)
    rows = paged_churn._churn_case(256, 80, 0.9, torch.int8, torch.Generator().manual_seed(0), 1, 2)
    assert [r["impl"] for r in rows] == [f"{p}, {layout}" for layout in ("heads side by side", "heads outer")
                                         for p in ("first free", "follows on", "one run each")
                                         if (p, layout) != ("one run each", "heads side by side")]
    outer = [r["bitwise as side by side"] for r in rows if r["impl"] in ("first free, heads outer",
                                                                          "follows on, heads outer")]
    assert outer == [True, True] and all(r["bitwise as side by side"] is None for r in rows if r["impl"] not in (
        "first free, heads outer", "follows on, heads outer"))
    assert rows[0]["time/before"] == 1.0 and all(r["ms"] > 0 and r["B"] > 1 for r in rows)
    assert rows[-1]["pages per run"] >= max(r["pages per run"] for r in rows)  # one run a sequence
