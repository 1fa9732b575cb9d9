"""Context parallelism over ``torch.distributed``: one sequence split across processes, every mask exact.

    from engine.distributed import context_parallel_attention, zigzag_indices
"""

from engine.distributed.context import METHODS, context_parallel_attention
from engine.distributed.zigzag import zigzag_indices, zigzag_shard, zigzag_unshard

__all__ = ["METHODS", "context_parallel_attention", "zigzag_indices", "zigzag_shard", "zigzag_unshard"]
