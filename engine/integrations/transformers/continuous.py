"""The engine under transformers' continuous batching: ``generate_batch``, ``init_continuous_batching``, and the
servers built on them.

transformers' continuous-batching manager runs a model only under the attention names it knows (``sdpa``,
``paged|eager``, flash ones) and refuses any other, ``engine`` included. ``continuous_batching()`` therefore
registers, through the library's public ``AttentionInterface.register`` and for as long as the block runs, a function
under those two names that sends every continuous-batching call to the engine and every other call, unchanged, to the
function it replaces; a model whose implementation is ``engine`` is switched to the name the manager accepts for the
block and switched back after::

    from engine.integrations.transformers import continuous_batching

    with continuous_batching(model):                   # the engine serves transformers' continuous batching
        outputs = model.generate_batch(inputs, generation_config=config)

What a continuous-batching call hands over, per layer (transformers writes the new K/V into its paged cache first,
then reads back each request's keys, packed):

    query [1, Hq, Nq, D]        the new tokens of every request, request r's at cu_seq_lens_q[r] .. [r+1]
    key, value [1, Hkv, Nk, D]  request r's keys at cu_seq_lens_k[r] .. [r+1], in order, its new ones last (a
                                sliding-window layer: only the keys its window can still see)

Each request is its own sequence, its queries its last keys: the engine's rule with per-request positions. The
largest group of requests with the same 1..16 new tokens (the decodes of a step, a mixed step's included) is one
paged call on the packed keys seen as pages of one token (``[Nk, 1, Hkv, D]``, a view): the native decode kernel
reads them in place; every other request (a prefill, a chunk) runs its own attention on views of its keys. Windows,
softcap and sinks (gpt-oss) apply as for any call; the additive mask transformers builds for sdpa is not read.

Planned once per forward (``BatchPlan``): the first layer reads the offsets to the host, groups the requests and
plans the decode step (``engine.plan_paged``: its table, lengths and the native call) and each other request's call
(``engine.plan``); every other layer with the same keys' layout runs those plans and reads nothing back to the host.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from engine.kernels.decode.decode_native import MAX_QUERIES
from engine.masks.window import window_mask
from engine.object_plans import snapshot, unwritten
from engine.paged.plan import PagedPlan, plan_paged
from engine.planning import Same, plan, reuse

__all__ = ["CONTINUOUS_NAMES", "continuous_batching", "continuous_batch_attention", "is_continuous_batch_call"]

CONTINUOUS_NAMES = ("sdpa", "paged|eager")  # the implementations transformers' continuous batching accepts


def is_continuous_batch_call(kwargs: dict) -> bool:
    """True for a call from transformers' continuous batching (its packed-batch keywords are there)."""
    return "cu_seq_lens_q" in kwargs and "cu_seq_lens_k" in kwargs and "read_index" in kwargs


def continuous_batch_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask=None, dropout: float = 0.0, scaling: float | None = None,
                               softcap: float | None = None, sliding_window: int | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """One layer of a continuous batch on the engine: ``(out [1, Nq, Hq, Dv], None)`` (transformers' layout).

    ``attention_mask`` (transformers' additive mask for sdpa) is not read: the sequences come from
    ``cu_seq_lens_q`` / ``cu_seq_lens_k``, the window from ``sliding_window``. The first layer of a forward plans
    it (``BatchPlan``); every other layer with the same keys' layout and options runs that plan."""
    if dropout:
        raise ValueError(f"continuous batching serves inference; got attention dropout {dropout}")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    window = int(sliding_window) if sliding_window is not None else None
    cu_k = kwargs["cu_seq_lens_k"]
    plans = _steps.plans_of(kwargs["cu_seq_lens_q"])
    found = reuse(plans, (Same(cu_k), window, softcap, scaling, Same(sinks)), (query, key, value),
                  lambda: plan_batch(query, key, value, kwargs["cu_seq_lens_q"], cu_k, window, scaling, softcap, sinks),
                  current=lambda made: cu_k is made.keep[1] and unwritten(made.key_offsets))
    return found.run(query, key, value), None


@dataclass(frozen=True)
class BatchPlan:
    """A continuous-batching forward's attention as its first layer planned it: the rows of the requests that step
    together (the largest group with the same 1..16 new tokens) and the paged plan of their decode step, and each
    other request's rows, key span and plan (a prefill, a chunk). ``keep``: the tensors whose identity keys it."""

    rows: int  # query rows, padding included
    stepped: torch.Tensor | None  # int64 [n]: the decode step's rows of the packed queries
    decode: PagedPlan | None
    requests: tuple  # ((q0, q1, k0, k1, AttentionPlan), ...)
    keep: tuple
    key_offsets: tuple = ()  # cu_seq_lens_k's snapshot when planned (engine.object_plans.snapshot)

    def run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[1, Nq_padded, Hq, Dv]``: rows past the batch's queries (a compiled batch's padding) get 0."""
        out = query.new_zeros(self.rows, query.shape[1], value.shape[3])  # [Nq_padded, Hq, Dv]
        if self.decode is not None:
            packed_q = query[0].transpose(0, 1)  # [Nq_padded, Hq, D]
            out[self.stepped] = self.decode.run(packed_q[self.stepped], _as_pages(key), _as_pages(value))
        for q0, q1, k0, k1, request in self.requests:  # prefills, chunks: each request's plan on views of its keys
            o = request.run(query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1])  # [1, Hq, T_r, Dv]
            out[q0:q1] = o[0].transpose(0, 1)
        return out.unsqueeze(0)  # [1, Nq_padded, Hq, Dv]


def plan_batch(query, key, value, cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor, window, scaling,
               softcap, sinks) -> BatchPlan:
    """Plan a continuous-batching forward's attention from its first layer's tensors (the one host read of the
    batch's offsets)."""
    cu_q, cu_k = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    live = [r for r, n in enumerate(q_lens) if n > 0]
    few = {} if softcap is not None else {n: [r for r in live if q_lens[r] == n] for n in {q_lens[r] for r in live}
                                          if n <= MAX_QUERIES}
    stepped = max(few.values(), key=len, default=[])  # the largest group of requests with the same few new tokens
    if not (len(stepped) >= 2 or len(stepped) == len(live)):
        stepped = []  # one request among others: its own call below
    rows, decode = None, None
    if stepped:
        rows = torch.cat([torch.arange(cu_q[r], cu_q[r + 1]) for r in stepped]).to(query.device)
        decode = _decode_step([cu_k[r] for r in stepped], [cu_k[r + 1] - cu_k[r] for r in stepped],
                              q_lens[stepped[0]], query[0].transpose(0, 1)[rows], key, value, window, scaling, sinks)
    requests = []
    for r in sorted(set(live) - set(stepped)):
        q_r = query[:, :, cu_q[r]:cu_q[r + 1]]  # [1, Hq, T_r, D]
        k_r, v_r = key[:, :, cu_k[r]:cu_k[r + 1]], value[:, :, cu_k[r]:cu_k[r + 1]]  # [1, Hkv, S_r, D]
        s, t = k_r.shape[2], q_r.shape[2]
        query_pos, key_pos = torch.arange(s - t, s, device=query.device), torch.arange(s, device=query.device)
        allowed = None if window is None else window_mask(query_pos, key_pos, window)
        requests.append((cu_q[r], cu_q[r + 1], cu_k[r], cu_k[r + 1],
                         plan(q_r, k_r, v_r, query_pos, key_pos, allowed, scaling, softcap=softcap, sinks=sinks)))
    return BatchPlan(query.shape[2], rows, decode, tuple(requests), (cu_seq_lens_q, cu_seq_lens_k, sinks),
                     snapshot(cu_seq_lens_k))


def _as_pages(x: torch.Tensor) -> torch.Tensor:
    """Packed keys ``[1, Hkv, Nk, D]`` as a pool of pages of one token, ``[Nk, 1, Hkv, D]`` (a view)."""
    return x[0].transpose(0, 1).unsqueeze(1)


def _decode_step(starts: list[int], lengths: list[int], t: int, q_rows, key, value, window, scaling,
                 sinks) -> PagedPlan:
    """The plan of the requests with the same ``t`` new tokens each (their rows ``q_rows [B*t, Hq, D]``, keys at
    ``starts`` for ``lengths``): one paged call, the packed keys as pages of one token (a view), read in place."""
    first, count = torch.tensor(starts), torch.tensor(lengths)  # [B], [B]
    last = max(starts[i] + lengths[i] for i in range(len(starts))) - 1
    table = (first[:, None] + torch.arange(max(max(lengths), 1))[None]).clamp(max=max(last, 0))  # [B, longest]
    indptr = torch.arange(len(starts) + 1) * t  # [B + 1]
    return plan_paged(q_rows, _as_pages(key), _as_pages(value), table, count, indptr, window=window, scale=scaling,
                      sinks=sinks, cascade=False)


class _Steps(threading.local):
    """The plans of the forward pass under way, in each thread (a manager steps its model in one): made by its first
    layer, reused by every other. A forward is known by its query offsets tensor (the same object, unchanged, in
    every layer of one forward; held here so that its id is not reused): another one, or the same one written
    since (engine.object_plans.unwritten), starts a new step."""

    def __init__(self) -> None:
        self.offsets: torch.Tensor | None = None
        self.state: tuple = ()
        self.plans: dict = {}

    def plans_of(self, cu_seq_lens_q: torch.Tensor) -> dict:
        if cu_seq_lens_q is not self.offsets or not unwritten(self.state):
            self.offsets, self.state, self.plans = cu_seq_lens_q, snapshot(cu_seq_lens_q), {}
        return self.plans


_steps = _Steps()


def _routed(original):
    """The function registered under a name continuous batching accepts: its calls to the engine, others to
    ``original``."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        if is_continuous_batch_call(kwargs):
            return continuous_batch_attention(module, query, key, value, attention_mask, **kwargs)
        return original(module, query, key, value, attention_mask, **kwargs)

    attention.engine_routes_from = original
    return attention


class _Blocks:
    """The ``continuous_batching`` blocks open now (any order of entering and leaving, any thread): the names are
    routed while at least one is open and given back their functions when the last one closes; a model switched to
    a name the manager accepts goes back to ``engine`` when the last block that holds it closes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.originals: dict[str, object] = {}
        self.models: dict[int, list] = {}  # id(model) -> [model, blocks holding it]

    def enter(self, model) -> None:
        with self.lock:
            if self.open == 0:
                current = {name: AttentionInterface()[name] for name in CONTINUOUS_NAMES}  # (the global functions)
                self.originals = {name: getattr(f, "engine_routes_from", f) for name, f in current.items()}
                for name, original in self.originals.items():
                    AttentionInterface.register(name, _routed(original))
            self.open += 1
            if model is None:
                return
            held = self.models.get(id(model))
            if held is not None:
                held[1] += 1
            elif model.config._attn_implementation == "engine":
                model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
                self.models[id(model)] = [model, 1]

    def leave(self, model) -> None:
        with self.lock:
            held = None if model is None else self.models.get(id(model))
            if held is not None:
                held[1] -= 1
                if held[1] == 0:
                    del self.models[id(model)]
                    model.set_attn_implementation("engine")
            self.open -= 1
            if self.open == 0:
                for name, original in self.originals.items():
                    AttentionInterface.register(name, original)


_blocks = _Blocks()


@contextlib.contextmanager
def continuous_batching(model: torch.nn.Module | None = None) -> Iterator[None]:
    """While the block runs, transformers' continuous batching computes attention on the engine (module docstring);
    ``model`` set to ``attn_implementation="engine"`` runs under ``sdpa`` (or ``eager`` where the model has no sdpa
    support: the manager makes it ``paged|eager``) for the block, then ``engine`` again. Blocks may nest or overlap
    (enter A, enter B, leave A, leave B): the routing and the switch last until the last block that needs them
    ends."""
    _blocks.enter(model)
    try:
        yield
    finally:
        _blocks.leave(model)
