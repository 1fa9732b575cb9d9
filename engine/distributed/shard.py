"""What one rank holds and what travels: a K/V shard with its positions and document ids, and the attention of
this rank's queries against one such shard.

Every rank's shard carries its own positions (and document ids), so the engine's rule and masks apply to a
shard exactly as to the whole sequence: ``key_pos <= query_pos``, the window and the documents are evaluated on
the shard's own values, and the parts merge exactly by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from engine.kernels.tiled.backward import tiled_backward
from engine.masks.causal import CausalMask
from engine.masks.documents import document_mask
from engine.masks.structured import StructuredMask
from engine.masks.window import window_mask
from engine.planning import AttentionPlan, plan, reuse

SEE_BLOCK = 256  # tile size of the skip decision


@dataclass(frozen=True)
class KeyShard:
    """Keys and values of one rank, as they travel: contiguous, positions and ids per batch row."""

    k: torch.Tensor  # [B, Hkv, S_r, D]
    v: torch.Tensor  # [B, Hkv, S_r, Dv]
    positions: torch.Tensor  # [B, S_r] int64
    documents: torch.Tensor | None  # [B, S_r] int64, or None without packed documents

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.positions] + ([] if self.documents is None else [self.documents])

    def like(self, length: int) -> KeyShard:
        """Empty buffers shaped as another rank's shard of ``length`` keys (to receive it into)."""
        b, h, _, d = self.k.shape
        new = lambda x, *shape: torch.empty(*shape, dtype=x.dtype, device=x.device)  # noqa: E731
        docs = None if self.documents is None else new(self.documents, b, length)
        return KeyShard(new(self.k, b, h, length, d), new(self.v, b, h, length, self.v.shape[3]),
                        new(self.positions, b, length), docs)

    def from_tensors(self, tensors: list[torch.Tensor]) -> KeyShard:
        return KeyShard(*tensors[:3], tensors[3] if self.documents is not None else None)


@dataclass(frozen=True)
class Queries:
    """This rank's queries and the call's options (the same on every rank)."""

    q: torch.Tensor  # [B, Hq, T_r, D]
    positions: torch.Tensor  # [B, T_r] int64
    documents: torch.Tensor | None  # [B, T_r] int64
    window: int | None
    causal: bool
    softcap: float | None
    scale: float
    # score modifiers, exact per shard: alibi_slopes, bias (a RelativePositionBias from global positions, or a dense
    # [B|1, Hq|1, T_r, S_total] tensor whose columns are global key positions), score_mod
    modifiers: dict = field(default_factory=dict)
    # attention dropout (p, seed): one seed for the whole call, the pattern hashed on global positions, so it is the
    # pattern one process draws for the whole sequence whatever the sharding
    dropout: tuple[float, int] | None = None
    # the plan of each ring step's shard (positions, masks, kernel: decided in the forward, reused by the backward,
    # which meets the same shards at the same steps)
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    step: int | None = None  # the ring step whose shard these queries attend to (at_step), for plans

    def allowed(self, shard: KeyShard) -> StructuredMask | None:
        """The window and document masks between these queries and one shard's keys."""
        mask = None
        if self.window is not None:
            mask = window_mask(self.positions, shard.positions, self.window)  # [B, 1, T_r, S_r]
        if self.documents is not None:
            docs = document_mask(self.documents, shard.documents)  # [B, 1, T_r, S_r]
            mask = docs if mask is None else mask & docs
        return mask

    def sees(self, shard: KeyShard) -> bool:
        """False when no query here can see any key of ``shard``, decided from positions and ids alone by the
        masks' per-tile bounds (tiles of ``SEE_BLOCK``: a zigzag shard's two distant chunks are judged apart)."""
        t, s = self.positions.shape[1], shard.positions.shape[1]
        if t == 0 or s == 0:
            return False
        parts = [] if not self.causal else [CausalMask(self.positions, shard.positions)]
        allowed = self.allowed(shard)
        mask = parts + ([] if allowed is None else [allowed])
        if not mask:
            return True
        visibility = mask[0] if len(mask) == 1 else mask[0] & mask[1]
        rows = range(self.positions.shape[0]) if visibility.batched() else range(1)
        return any(bool(visibility.tile_bounds(b, SEE_BLOCK, SEE_BLOCK, t, s)[0].any()) for b in rows)

    def at_step(self, step: int) -> Queries:
        """These queries at ring step ``step`` (sharing one dict of plans across steps, forward and backward)."""
        return replace(self, step=step)

    def plan_for(self, shard: KeyShard) -> AttentionPlan:
        """The plan of these queries against ``shard``, made once per ring step (not kept outside a ring)."""
        def make() -> AttentionPlan:
            made = plan(self.q, shard.k, shard.v, self.positions, shard.positions, self.allowed(shard), self.scale,
                        causal=self.causal, softcap=self.softcap, **self.modifiers_for(shard),
                        **({} if self.dropout is None else {"dropout_p": self.dropout[0],
                                                            "generator": torch.Generator()}))
            if self.dropout is not None:  # the call's seed, and its global positions as the pattern's indices
                made = with_dropout_pattern(made, self.dropout[1], self.positions[0], shard.positions[0])
            return made

        return make() if self.step is None else reuse(self.plans, self.step, (self.q, shard.k, shard.v), make)

    def modifiers_for(self, shard: KeyShard) -> dict:
        """The modifiers of a call on ``shard``: a dense bias ``[.., T_r, S_total]`` (columns = global key positions)
        cut to the shard's keys."""
        bias = self.modifiers.get("bias")
        if isinstance(bias, torch.Tensor):
            columns = bias.index_select(-1, shard.positions[0])
            if bias.requires_grad and not columns.requires_grad:  # cut inside the ring's autograd function: the plan
                columns.requires_grad_(True)  # must still know the bias is learned (its gradient is scattered back)
            return {**self.modifiers, "bias": columns}
        return self.modifiers

    def attend(self, shard: KeyShard) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, T_r, Dv], lse [B, Hq, T_r])`` of these queries against one shard (no autograd)."""
        return self.plan_for(shard).run(self.q, shard.k, shard.v, return_lse=True)

    def gradients(self, shard: KeyShard, out, lse, grad_out, grad_lse):
        """This shard's share of ``(dq, dk, dv)``, from the merged output and lse (exact: the softmax weights
        are ``exp(s - lse)`` with the global lse); the forward's plan of this step gives the inputs."""
        inputs = self.plan_for(shard).inputs.with_tensors(self.q, shard.k, shard.v)
        grads = tiled_backward(inputs, out, lse, grad_out, grad_lse)
        bias = self.modifiers.get("bias")
        if len(grads) == 4 and isinstance(bias, torch.Tensor):  # a learned dense bias: its shard's columns, placed
            full = torch.zeros(bias.shape, dtype=grads[3].dtype, device=bias.device)
            grads = (*grads[:3], full.index_add_(-1, shard.positions[0], grads[3]))
        return grads

    def with_q(self, q: torch.Tensor) -> Queries:
        return replace(self, q=q)


def with_dropout_pattern(found: AttentionPlan, seed: int, query_index: torch.Tensor,
                         key_index: torch.Tensor) -> AttentionPlan:
    """``found`` drawing its dropout pattern from ``seed`` on these indices (int64 ``[T]``, ``[S]``)."""
    modifiers = replace(found.inputs.modifiers, dropout_seed=seed, dropout_query_index=query_index,
                        dropout_key_index=key_index)
    return replace(found, inputs=replace(found.inputs, modifiers=modifiers))
