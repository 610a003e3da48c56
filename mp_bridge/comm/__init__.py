"""Floor 2: autograd-aware collectives, the colocated bridge, and sequence partitioning.

Three wings, each a subpackage: ``collectives`` (differentiable collectives and plain
helpers, the deterministic all-reduce, the CP K/V gather), ``bridge`` (plans, the
communicator, ragged and routed variants, the per-sample count check) and ``sequence``
(the CP cut, padding to the cut, the packed mask, the partition adapter). Everything other
packages use is exported here: import from ``mp_bridge.comm``, not from its modules.
"""

from mp_bridge.checks import (
    AgreementError,
    check_agreement,
    check_group_arg,
    checks_enabled,
    fingerprint,
    run_checked,
)
from mp_bridge.comm.bridge.bridge_protocol import Bridge
from mp_bridge.comm.bridge.execution.balancer import ImageBalancer
from mp_bridge.comm.bridge.execution.bridge_groups import BridgeGroups, make_bridge_groups
from mp_bridge.comm.bridge.execution.communicator import ColocatedBridgeCommunicator
from mp_bridge.comm.bridge.execution.ragged import exchange_rows
from mp_bridge.comm.bridge.execution.sample_counts import check_sample_counts
from mp_bridge.comm.bridge.local_bridge import LocalBridge
from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan, plan_balance
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan, plan_bridge
from mp_bridge.comm.bridge.plans.count_rows import CountRow
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache, RouteCache
from mp_bridge.comm.bridge.plans.plan_groups import format_rank_table
from mp_bridge.comm.bridge.plans.ragged import RaggedRoute, route_ragged
from mp_bridge.comm.bridge.plans.route import (
    RankRoute,
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from mp_bridge.comm.bridge.plans.row_move import MoveLeg, RowMove
from mp_bridge.comm.collectives.deterministic import deterministic_all_reduce
from mp_bridge.comm.collectives.heads_all_to_all import heads_to_seq, seq_to_heads
from mp_bridge.comm.collectives.kv_gather import GatherKV, ReduceScatterKV, gather_kv
from mp_bridge.comm.collectives.primitives import (
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
from mp_bridge.comm.collectives.ring_exchange import RingStep, ring_neighbours
from mp_bridge.comm.sequence.cut import (
    cp_factor,
    cp_gather_order,
    cp_shard_indices,
    cp_shard_indices_packed,
    normalize_cu_seqlens,
    seq_len_divisor,
)
from mp_bridge.comm.sequence.mask import packed_sequence_mask
from mp_bridge.comm.sequence.padding import PaddedLayout, pad_layout
from mp_bridge.comm.sequence.partition import PAD_LABEL, PartitionAdapter, ShardedBatch
from mp_bridge.comm.sequence.samples import sample_sums

__all__ = [
    # differentiable collectives (primitives.py)
    "copy_to_group",
    "gather_along",
    "gather_keep_grad",
    "reduce_from_group",
    "reduce_scatter_along",
    "scatter_along",
    "forbid_double_backward",
    "seq_to_heads",
    "heads_to_seq",
    "RingStep",
    "ring_neighbours",
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
    "Bridge",
    "LocalBridge",
    "BridgeGroups",
    "make_bridge_groups",
    "RaggedRoute",
    "route_ragged",
    "exchange_rows",
    "RankRoute",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
    "PlanCache",
    "MoveLeg",
    "RowMove",
    "RouteCache",
    "ImageBalancer",
    "BalancePlan",
    "plan_balance",
    "CountRow",
    "check_sample_counts",
    "format_rank_table",
    # context parallelism
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
    "sample_sums",
    "deterministic_all_reduce",
    # agreement checks (checks/agreement.py)
    "AgreementError",
    "check_agreement",
    "check_group_arg",
    "checks_enabled",
    "fingerprint",
    "run_checked",
    # deprecated alias (DeprecationWarning when called): seq_len_divisor
    "cp_factor",
]
