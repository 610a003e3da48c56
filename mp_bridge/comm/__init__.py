"""Autograd-aware collectives, the colocated bridge, and sequence partitioning.

Everything other packages use from ``comm`` is exported here (import from
``mp_bridge.comm``, not from its modules): the differentiable collectives and their plain
helpers (``primitives``), the CP cut (``cp_indices``), the packed-sequence mask
(``cp_mask``), padding to the cut (``cp_padding``), the CP K/V gather (``kv_gather``),
the bridge (its ``route`` plan in ``route_plan``, its per-sample count check in
``sample_counts``) and the partition adapter.
"""

from .agreement import (
    AgreementError,
    check_agreement,
    check_group_arg,
    checks_enabled,
    fingerprint,
    run_checked,
)
from .bridge import ColocatedBridgeCommunicator
from .bridge_plan import BridgeDirection, BridgePlan, format_rank_table, plan_bridge
from .cp_indices import (
    cp_factor,
    cp_gather_order,
    cp_shard_indices,
    cp_shard_indices_packed,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from .cp_mask import packed_sequence_mask
from .cp_padding import PaddedLayout, pad_layout
from .deterministic import deterministic_all_reduce
from .kv_gather import GatherKV, ReduceScatterKV, gather_kv
from .partition import PAD_LABEL, PartitionAdapter, ShardedBatch
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
from .ragged import exchange_rows
from .ragged_plan import RaggedRoute, route_ragged
from .route_plan import (
    RankRoute,
    RouteCache,
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from .sample_counts import CountRow, check_sample_counts

__all__ = [
    # differentiable collectives (primitives.py)
    "copy_to_group",
    "gather_along",
    "gather_keep_grad",
    "reduce_from_group",
    "reduce_scatter_along",
    "scatter_along",
    "forbid_double_backward",
    # plain (non-autograd) helpers (primitives.py)
    "all_gather_tensor",
    "all_reduce_sum",
    "group_rank",
    "group_size",
    "reduce_scatter_tensor",
    # bridge
    "plan_bridge",
    "BridgePlan",
    "BridgeDirection",
    "ColocatedBridgeCommunicator",
    "RaggedRoute",
    "route_ragged",
    "exchange_rows",
    "RankRoute",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
    "RouteCache",
    "CountRow",
    "check_sample_counts",
    "format_rank_table",
    # context parallelism
    "cp_factor",
    "cp_gather_order",
    "cp_shard_indices",
    "cp_shard_indices_packed",
    "normalize_cu_seqlens",
    "packed_sequence_mask",
    "seq_len_divisor",
    "GatherKV",
    "ReduceScatterKV",
    "gather_kv",
    "PartitionAdapter",
    "ShardedBatch",
    "PAD_LABEL",
    "PaddedLayout",
    "pad_layout",
    "deterministic_all_reduce",
    # agreement checks (agreement.py)
    "AgreementError",
    "check_agreement",
    "check_group_arg",
    "checks_enabled",
    "fingerprint",
    "run_checked",
]
