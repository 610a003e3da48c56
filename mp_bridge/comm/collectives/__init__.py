"""Autograd-aware collectives (Function + lowercase wrapper), the deterministic all-reduce
and the CP K/V gather.
"""

from .deterministic import deterministic_all_reduce
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

__all__ = [
    "deterministic_all_reduce",
    "GatherKV",
    "ReduceScatterKV",
    "gather_kv",
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
