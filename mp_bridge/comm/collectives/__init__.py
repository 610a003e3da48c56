"""Autograd-aware collectives (Function + lowercase wrapper), the deterministic all-reduce
and the CP K/V gather.
"""

from .deterministic import deterministic_all_reduce
from .heads_all_to_all import heads_to_seq, seq_to_heads
from .kv_gather import GatherKV, ReduceScatterKV, gather_kv
from .primitives import (
    all_gather_tensor,
    all_reduce_sum,
    copy_to_group,
    forbid_double_backward,
    gather_along,
    gather_keep_grad,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_along,
    reduce_scatter_tensor,
    scatter_along,
)
from .ring_exchange import RingStep, ring_neighbours

__all__ = [
    "deterministic_all_reduce",
    "GatherKV",
    "ReduceScatterKV",
    "gather_kv",
    "heads_to_seq",
    "seq_to_heads",
    "RingStep",
    "ring_neighbours",
    "all_gather_tensor",
    "all_reduce_sum",
    "copy_to_group",
    "forbid_double_backward",
    "gather_along",
    "gather_keep_grad",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_along",
    "reduce_scatter_tensor",
    "scatter_along",
]
