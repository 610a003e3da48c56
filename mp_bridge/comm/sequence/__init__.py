"""Sequence partitioning: the load-balanced CP cut, padding to the cut, the packed mask and
the partition adapter.
"""

from .cut import (
    cp_factor,
    cp_gather_order,
    cp_shard_indices,
    cp_shard_indices_packed,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from .mask import packed_sequence_mask
from .padding import PaddedLayout, pad_layout
from .partition import PAD_LABEL, PartitionAdapter, ShardedBatch
from .samples import sample_sums

__all__ = [
    "cp_gather_order",
    "cp_shard_indices",
    "cp_shard_indices_packed",
    "normalize_cu_seqlens",
    "seq_len_divisor",
    "packed_sequence_mask",
    "PaddedLayout",
    "pad_layout",
    "PAD_LABEL",
    "PartitionAdapter",
    "ShardedBatch",
    "sample_sums",
    # deprecated alias (DeprecationWarning when called): seq_len_divisor
    "cp_factor",
]
