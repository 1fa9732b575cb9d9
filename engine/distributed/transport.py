"""Point-to-point transfers of the context-parallel methods (ring, direct): post every send and receive at once,
wait for all of them later, each wait bounded; a transport error says which rank lost which peers."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["transfer"]


def transfer(sends: dict[int, list[torch.Tensor]], receives: dict[int, list[torch.Tensor]], group,
             timeout: timedelta | None, what: str) -> Callable[[], dict[int, list[torch.Tensor]]]:
    """Post the sends of ``sends[dst]`` and the receives into ``receives[src]`` (group ranks); returns a function
    that waits for all of them (each wait bounded by ``timeout``, else the group's) and returns ``receives``.
    ``what``: the peers, for the error a dead or hung peer raises when posting or waiting."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def lost(error: RuntimeError) -> RuntimeError:  # a peer died or hung: say where, keep the transport's reason
        return RuntimeError(f"context_parallel_attention: rank {rank} of {world} lost {what}: {error}")

    try:
        works = [dist.isend(t.contiguous(), group=group, group_dst=dst) for dst, ts in sends.items() for t in ts]
        works += [dist.irecv(b, group=group, group_src=src) for src, bs in receives.items() for b in bs]
    except RuntimeError as error:
        raise lost(error) from error

    def wait() -> dict[int, list[torch.Tensor]]:
        try:
            for work in works:
                work.wait(timeout) if timeout is not None else work.wait()
        except RuntimeError as error:
            raise lost(error) from error
        return receives
    return wait
