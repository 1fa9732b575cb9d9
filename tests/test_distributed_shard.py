"""The ring's skip decision, without processes: ``Queries.sees(shard)`` must be True whenever some query sees some
key of the shard (skipping it would drop keys), and it is exact on zigzag shards under a window."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from engine import document_mask, window_mask
from engine.distributed import zigzag_indices
from engine.distributed.shard import KeyShard, Queries


def _queries(positions, documents=None, window=None, causal=True):
    q = torch.zeros(1, 1, positions.shape[-1], 4)
    return Queries(q, positions.expand(1, -1), None if documents is None else documents.expand(1, -1), window,
                   causal, None, 1.0)


def _shard(positions, documents=None):
    k = torch.zeros(1, 1, positions.shape[-1], 4)
    return KeyShard(k, k, positions.expand(1, -1), None if documents is None else documents.expand(1, -1))


def _dense(qpos, kpos, qdoc, kdoc, window, causal):
    """The rule written out: which (query, key) pairs are visible."""
    visible = torch.ones(qpos.shape[0], kpos.shape[0], dtype=torch.bool)
    if causal:
        visible &= kpos[None, :] <= qpos[:, None]
    if window is not None:
        visible &= window_mask(qpos, kpos, window).to_dense()
    if qdoc is not None:
        visible &= document_mask(qdoc, kdoc).to_dense()
    return visible


@given(length=st.integers(2, 1500), world=st.integers(2, 4), data=st.data())
def test_a_shard_is_skipped_only_when_no_query_sees_it(length, world, data):
    window = data.draw(st.one_of(st.none(), st.integers(1, 600)))
    causal = data.draw(st.booleans())
    documents = torch.arange(length) // data.draw(st.integers(1, 700)) if data.draw(st.booleans()) else None
    mine, theirs = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, world - 1))
    qpos, kpos = zigzag_indices(length, mine, world), zigzag_indices(length, theirs, world)
    qdoc = None if documents is None else documents[qpos]
    kdoc = None if documents is None else documents[kpos]
    sees = _queries(qpos, qdoc, window, causal).sees(_shard(kpos, kdoc))
    if bool(_dense(qpos, kpos, qdoc, kdoc, window, causal).any()):
        assert sees  # a shard some query sees is never skipped


def test_zigzag_window_shards_are_judged_chunk_by_chunk():
    # T = 8192 over 4 ranks, window 512: each rank's two chunks are 1024 tokens apart or more, so a rank sees
    # only the shards next to its chunks; judged per tile, the ring computes exactly those.
    length, world, window = 8192, 4, 512
    shards = [zigzag_indices(length, r, world) for r in range(world)]
    for mine in range(world):
        queries = _queries(shards[mine], window=window)
        decided = [queries.sees(_shard(shards[r])) for r in range(world)]
        truth = [bool(_dense(shards[mine], shards[r], None, None, window, True).any()) for r in range(world)]
        assert decided == truth, (mine, decided, truth)
