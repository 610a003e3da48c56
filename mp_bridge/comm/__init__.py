"""Autograd-aware collectives, the colocated bridge, and sequence partitioning."""

from mp_bridge._lazy import lazy_exports

from .primitives import (
    copy_to_group,
    gather_along,
    gather_keep_grad,
    reduce_from_group,
    reduce_scatter_along,
    scatter_along,
)

_EXPORTS = {
    "plan_bridge": "bridge_plan",
    "BridgePlan": "bridge_plan",
    "BridgeDirection": "bridge_plan",
    "ColocatedBridgeCommunicator": "bridge",
    "cp_shard_indices": "cp_indices",
    "cp_shard_indices_packed": "cp_indices",
    "PartitionAdapter": "partition",
    "ShardedBatch": "partition",
    "deterministic_all_reduce": "deterministic",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "copy_to_group",
    "gather_along",
    "gather_keep_grad",
    "reduce_from_group",
    "reduce_scatter_along",
    "scatter_along",
    *_EXPORTS,
]
