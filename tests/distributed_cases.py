"""Multi-process harness for the context-parallel tests: spawn P gloo ranks on loopback, run one function on
each, collect what each returns. Every process group has a timeout, the parent joins with a deadline and kills
every child past it, so nothing here can hang."""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import causal_attention, document_mask, window_mask
from engine.distributed import context_parallel_attention, zigzag_indices
from engine.relative_bias import RelativePositionBias

GROUP_TIMEOUT = datetime.timedelta(seconds=20)


def _entry(fn, rank: int, world: int, store_path: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
        result = fn(rank, world, *args)
    except BaseException as error:  # recorded for the parent, which asserts on it
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, deadline_s: float = 120.0) -> list:
    """``[fn(rank, world, *args) for each rank]``, each in its own process; a rank that has not finished within
    ``deadline_s`` is killed (with all the others) and this raises TimeoutError."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [context.Process(target=_entry, args=(fn, rank, world, store_path, tmp, args)) for rank in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if alive:
            raise TimeoutError(f"ranks {alive} of {world} still running after {deadline_s} s: killed")
        results = []
        for rank in range(world):
            path = os.path.join(tmp, f"{rank}.pkl")
            results.append(pickle.load(open(path, "rb")) if os.path.exists(path) else {"error": "no result (died)"})
        return results


def in_turn(rank: int, world: int, calls: list) -> list:
    """``[fn(rank, world, *args) for fn, args in calls]`` on one process group, in order (``run_ranks(in_turn, world,
    calls)``: several tests' calls share one spawn of the ranks); a call that raises gives what ``_entry`` records
    for it (``{"error", "traceback"}``) and the next call runs."""
    results = []
    for fn, args in calls:
        try:
            results.append(fn(rank, world, *args))
        except BaseException as error:  # recorded for the parent, which asserts on it
            results.append({"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
    return results


# --- the cases -------------------------------------------------------------------------------------------


def _inputs(b, hq, hkv, length, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, length, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _case(name: str, rank: int, world: int) -> dict:
    """One case: the full problem (built identically on every rank), this rank's shard of queries and keys, and
    the keyword arguments of both calls."""
    length, b, hq, hkv, d, dtype = 101, 1, 4, 2, 8, torch.float64
    if name == "mqa":
        hkv = 1
    if name in ("bf16", "bf16_modifiers"):
        dtype = torch.bfloat16
    if name == "ragged_rows":
        b = 2
    q, k, v = _inputs(b, hq, hkv, length, d, dtype)
    pos = torch.arange(length)
    qpos = kpos = pos
    full_kwargs, cp_kwargs = {}, {}
    keys = torch.tensor_split(pos, world)[rank]  # contiguous shards of uneven length
    queries = keys
    if name in ("causal_zigzag", "documents", "bf16", "mqa", "sinks", "alibi", "relative_bias", "score_mod",
                "dense_bias", "dropout", "bf16_modifiers"):
        keys = queries = zigzag_indices(length, rank, world)
    if name == "chunked_prefill":  # the last 23 tokens are new: only the ranks that hold them have queries
        queries = keys[keys >= length - 23]
    if name == "documents":
        ids = pos // 30
        full_kwargs["allowed"] = document_mask(ids)
        cp_kwargs.update(query_document_ids=ids[queries], key_document_ids=ids[keys])
    if name == "window":
        full_kwargs["allowed"] = window_mask(pos, pos, 13)
        cp_kwargs["window"] = 13
    if name == "sinks":  # with a window: gpt-oss's layers; the sinks' gradient is checked too
        full_kwargs.update(allowed=window_mask(pos, pos, 13), sinks=torch.linspace(-2.0, 3.0, hq, dtype=dtype))
        cp_kwargs.update(window=13, sinks=full_kwargs["sinks"])
    if name == "bf16_modifiers":  # gpt-oss-like: sinks and a window, with ALiBi, in bf16
        full_kwargs.update(allowed=window_mask(pos, pos, 13), sinks=torch.linspace(-2.0, 3.0, hq).to(dtype),
                           alibi_slopes=torch.linspace(0.05, 0.5, hq).to(dtype))
        cp_kwargs.update(window=13, sinks=full_kwargs["sinks"], alibi_slopes=full_kwargs["alibi_slopes"])
    if name == "alibi":
        full_kwargs["alibi_slopes"] = cp_kwargs["alibi_slopes"] = torch.linspace(0.05, 0.5, hq, dtype=dtype)
    if name == "relative_bias":  # T5's bucketed bias, a learned table: its gradient is checked too
        table = torch.randn(hq, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
        full_kwargs["bias"] = cp_kwargs["bias"] = RelativePositionBias(table, bidirectional=False, max_distance=40)
    if name == "dense_bias":  # [1, Hq, T, S]: each rank holds its queries' rows, every key's column
        full_kwargs["bias"] = torch.randn(1, hq, length, length, generator=torch.Generator().manual_seed(4),
                                          dtype=torch.float64).to(dtype)
        cp_kwargs["bias"] = full_kwargs["bias"][:, :, queries]
    if name == "dropout":  # the same generator state: the one process's pattern, whatever the sharding
        full_kwargs.update(dropout_p=0.3, generator=torch.Generator().manual_seed(7))
        cp_kwargs.update(dropout_p=0.3, generator=torch.Generator().manual_seed(7))
    if name == "score_mod":  # a function of global positions (and heads): exact per shard
        def mod(score, batch, head, query_pos, key_pos):
            return score - 0.002 * (query_pos - key_pos).to(score.dtype) ** 2 + 0.1 * head.to(score.dtype)
        full_kwargs["score_mod"] = cp_kwargs["score_mod"] = mod
    if name == "ragged_rows":  # row 1 is a shorter sequence: 20 pads first (their own document), positions per row
        ids = torch.stack([torch.zeros(length, dtype=torch.long), (pos >= 20).long()])  # [2, L]
        qpos = kpos = torch.stack([pos, (pos - 20).clamp(min=0)])  # [2, L]
        full_kwargs["allowed"] = document_mask(ids)
        cp_kwargs.update(query_document_ids=ids[:, queries], key_document_ids=ids[:, keys])
    first = length - 23 if name == "chunked_prefill" else 0  # the one-process call's queries: first .. L-1
    return dict(q=q[:, :, first:], k=k, v=v, qpos=qpos[..., first:], kpos=kpos, full_kwargs=full_kwargs,
                cp_kwargs=cp_kwargs, keys=keys, rows=queries - first)  # rows: this rank's rows of that call


CASES = ["causal_contiguous", "causal_zigzag", "chunked_prefill", "documents", "window", "ragged_rows", "mqa",
         "bf16", "sinks", "alibi", "relative_bias", "score_mod", "dense_bias", "dropout", "bf16_modifiers"]


def compare_with_single_process(rank: int, world: int, method: str) -> dict:
    """Max |difference| of out, lse, dq, dk, dv between context parallelism and one process, per case."""
    errors = {}
    for name in CASES:
        c = _case(name, rank, world)
        leaves = [x.clone().requires_grad_(True) for x in (c["q"], c["k"], c["v"])]
        shared = {}  # a replicated parameter (sinks, a bias table): a leaf of its own in each call, gradient compared
        if "sinks" in c["full_kwargs"]:
            shared = {call: c[call]["sinks"].clone().requires_grad_(True) for call in ("full_kwargs", "cp_kwargs")}
            for call, leaf in shared.items():
                c[call]["sinks"] = leaf
        own_rows = {}  # a dense bias: each rank's rows are its own leaf, their gradient compared row for row
        if isinstance(c["full_kwargs"].get("bias"), torch.Tensor):
            own_rows = {call: c[call]["bias"].clone().requires_grad_(True) for call in ("full_kwargs", "cp_kwargs")}
            for call, leaf in own_rows.items():
                c[call]["bias"] = leaf
        elif "bias" in c["full_kwargs"]:
            bias = c["full_kwargs"]["bias"]
            shared = {call: bias.table.clone().requires_grad_(True) for call in ("full_kwargs", "cp_kwargs")}
            for call, leaf in shared.items():
                c[call]["bias"] = RelativePositionBias(leaf, bias.bidirectional, bias.max_distance)
        out, lse = causal_attention(*leaves, c["qpos"], c["kpos"], return_lse=True, **c["full_kwargs"])
        g = torch.Generator().manual_seed(1)
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        grad_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
        ((out * grad_out).sum() + (lse.masked_fill(lse.isinf(), 0) * grad_lse).sum()).backward()
        qpos = c["qpos"][..., c["rows"]]
        kpos = c["kpos"][..., c["keys"]]
        shards = [c["q"][:, :, c["rows"]], c["k"][:, :, c["keys"]], c["v"][:, :, c["keys"]]]
        shards = [x.clone().requires_grad_(True) for x in shards]
        cp_out, cp_lse = context_parallel_attention(*shards, qpos, kpos, method=method, return_lse=True,
                                                    **c["cp_kwargs"])
        rows = c["rows"]
        ((cp_out * grad_out[:, :, rows]).sum() + (cp_lse.masked_fill(cp_lse.isinf(), 0) * grad_lse[:, :, rows]).sum()
         ).backward()
        diff = lambda a, b: float((a.double() - b.double()).abs().max()) if a.numel() else 0.0  # noqa: E731
        errors[name] = {
            "out": diff(cp_out, out.detach()[:, :, rows]),
            "lse_inf_pattern": bool(torch.equal(cp_lse.isinf(), lse.detach()[:, :, rows].isinf())),
            "lse": diff(cp_lse.masked_fill(cp_lse.isinf(), 0), lse.detach()[:, :, rows].masked_fill(
                lse.detach()[:, :, rows].isinf(), 0)),
            "dq": diff(shards[0].grad, leaves[0].grad[:, :, rows]),
            "dk": diff(shards[1].grad, leaves[1].grad[:, :, c["keys"]]),
            "dv": diff(shards[2].grad, leaves[2].grad[:, :, c["keys"]]),
            "dtype": str(c["q"].dtype),
        }
        if own_rows:
            errors[name]["dbias"] = diff(own_rows["cp_kwargs"].grad, own_rows["full_kwargs"].grad[:, :, rows])
        if shared:  # this rank's rows' share, and the whole sequence's (the test sums the ranks' shares)
            errors[name]["dshared_share"] = shared["cp_kwargs"].grad.double()
            errors[name]["dshared_full"] = shared["full_kwargs"].grad.double()
    return errors


def mismatched_heads(rank: int, world: int) -> dict:
    """Rank 1 passes a different number of KV heads: every rank must refuse, naming rank 1."""
    q, k, v = _inputs(1, 4, 2 if rank != 1 else 4, 8, 4, torch.float32)
    pos = torch.arange(8)
    context_parallel_attention(q, k, v, pos, pos)
    return {"error": None}


def one_rank_dies(rank: int, world: int, mid_ring: bool = False, method: str = "auto") -> dict:
    """Rank 1 dies between two calls, or in the middle of the ring (while computing its first shard, after it
    posted that step's sends, before the next step's); the others must fail within their timeout, not hang.
    (``method="direct"``: rank 1 dies after posting its sends to every reader, before it receives.)"""
    q, k, v = _inputs(1, 2, 1, 64, 4, torch.float32)
    pos = torch.arange(64)
    idx = zigzag_indices(64, rank, world)
    context_parallel_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], idx, idx,
                               method=method)  # all ranks agree on shapes
    if rank == 1 and not mid_ring:
        os._exit(1)  # dies between two calls, without a word to the others
    if rank == 1:
        from engine.distributed import shard

        attend, calls = shard.Queries.attend, []

        def dies_on_its_first_shard(self, key_shard):
            calls.append(1)
            if len(calls) == 1:
                os._exit(1)
            return attend(self, key_shard)
        shard.Queries.attend = dies_on_its_first_shard
    start = time.monotonic()
    try:
        context_parallel_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], pos[idx], pos[idx], method=method,
                                   timeout=datetime.timedelta(seconds=5))
    except Exception as error:  # the point: an error, within the timeout
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"raised": None, "seconds": time.monotonic() - start}


def _tiny_model(seed: int = 0):
    """Embeddings -> q, k, v projections (GQA: 4 query heads, 2 KV heads) -> attention -> output projection."""
    g = torch.Generator().manual_seed(seed)
    vocab, width, heads, kv_heads, d = 11, 16, 4, 2, 4
    params = {"embed": torch.randn(vocab, width, generator=g) * 0.5,
              "wq": torch.randn(width, heads * d, generator=g) * 0.3,
              "wk": torch.randn(width, kv_heads * d, generator=g) * 0.3,
              "wv": torch.randn(width, kv_heads * d, generator=g) * 0.3,
              "wo": torch.randn(heads * d, vocab, generator=g) * 0.3}
    return {name: p.double().requires_grad_(True) for name, p in params.items()}, (heads, kv_heads, d)


def _loss(params, shape, tokens, targets, positions, attend):
    heads, kv_heads, d = shape
    x = params["embed"][tokens]  # [1, L_r, E]
    split = lambda y, h: y.view(1, -1, h, d).transpose(1, 2)  # noqa: E731  [1, h, L_r, d]
    q, k, v = split(x @ params["wq"], heads), split(x @ params["wk"], kv_heads), split(x @ params["wv"], kv_heads)
    out = attend(q, k, v, positions)  # [1, heads, L_r, d]
    logits = out.transpose(1, 2).reshape(1, -1, heads * d) @ params["wo"]  # [1, L_r, vocab]
    return torch.nn.functional.cross_entropy(logits[0], targets, reduction="sum")


def tiny_training(rank: int, world: int, steps: int = 5) -> dict:
    """The same model trained by SGD on one sequence, by one process and by ``world`` ranks (zigzag shards, loss
    and parameter gradients summed over ranks): the loss curves."""
    g = torch.Generator().manual_seed(3)
    length = 48
    tokens = torch.randint(0, 11, (1, length), generator=g)
    targets = torch.randint(0, 11, (length,), generator=g)
    pos = torch.arange(length)
    curves = {}
    for mode in ("one process", "context parallel"):
        params, shape = _tiny_model()
        losses = []
        for _ in range(steps):
            if mode == "one process":
                loss = _loss(params, shape, tokens, targets, pos, lambda q, k, v, p: causal_attention(q, k, v, p, p))
                total = loss.detach().clone()
            else:
                idx = zigzag_indices(length, rank, world)
                loss = _loss(params, shape, tokens[:, idx], targets[idx], idx,
                             lambda q, k, v, p: context_parallel_attention(q, k, v, p, p))
                total = loss.detach().clone()
                dist.all_reduce(total)
            loss.backward()
            with torch.no_grad():
                for p in params.values():
                    if mode == "context parallel":
                        dist.all_reduce(p.grad)
                    p -= 0.01 * p.grad
                    p.grad = None
            losses.append(float(total) / length)
        curves[mode] = losses
    return curves


def auto_method_choice(rank: int, world: int) -> dict:
    """Which method ``method="auto"`` runs: contiguous shards with a window reach only neighbours (direct); zigzag
    causal shards see every rank (ring)."""
    from engine.distributed import direct, ring

    chosen = []
    ring_apply, direct_apply = ring.RingAttention.apply, direct.DirectAttention.apply
    ring.RingAttention.apply = lambda *a: chosen.append("ring") or ring_apply(*a)
    direct.DirectAttention.apply = lambda *a: chosen.append("direct") or direct_apply(*a)
    q, k, v = _inputs(1, 4, 2, 256, 8, torch.float64)
    contiguous, zigzag = torch.tensor_split(torch.arange(256), world)[rank], zigzag_indices(256, rank, world)
    picks = {}
    for name, idx, window in (("window", contiguous, 16), ("causal", zigzag, None)):
        context_parallel_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], idx, idx, window=window)
        picks[name] = chosen.pop()
    return picks
