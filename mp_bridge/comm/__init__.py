"""Autograd-aware collectives, the colocated bridge, and sequence partitioning."""

from .bridge import ColocatedBridgeCommunicator
from .bridge_plan import BridgeDirection, BridgePlan, plan_bridge
from .cp_indices import cp_shard_indices, cp_shard_indices_packed
from .deterministic import deterministic_all_reduce
from .partition import PartitionAdapter, ShardedBatch
from .primitives import (
    copy_to_group,
    gather_along,
    gather_keep_grad,
    reduce_from_group,
    reduce_scatter_along,
    scatter_along,
)

__all__ = [
    "copy_to_group",
    "gather_along",
    "gather_keep_grad",
    "reduce_from_group",
    "reduce_scatter_along",
    "scatter_along",
    "plan_bridge",
    "BridgePlan",
    "BridgeDirection",
    "ColocatedBridgeCommunicator",
    "cp_shard_indices",
    "cp_shard_indices_packed",
    "PartitionAdapter",
    "ShardedBatch",
    "deterministic_all_reduce",
]
