"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

:func:`ring_attention` computes exact attention on each rank's shard (K/V travel around a ring,
or are all-gathered once); :func:`shard_sequence` / :func:`unshard_sequence` /
:func:`position_ids` move tensors and positions between the full sequence and a layout's shards;
:func:`context_parallel` makes the self-attention of a ``selfattn.nn`` model use the ring.
A bad argument on any rank makes every rank raise :class:`DistributedArgumentError` (no hang).
"""

from selfattn.distributed.checks import DistributedArgumentError
from selfattn.distributed.model import ContextParallelAttention, context_parallel
from selfattn.distributed.ring import METHODS, ring_attention
from selfattn.distributed.shard import (
    LAYOUTS,
    position_ids,
    segments,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "LAYOUTS",
    "METHODS",
    "ContextParallelAttention",
    "DistributedArgumentError",
    "context_parallel",
    "position_ids",
    "ring_attention",
    "segments",
    "shard_sequence",
    "unshard_sequence",
]
