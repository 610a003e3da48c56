"""The colocated bridge: pure plans (dense, ragged, routed, balanced), the communicator that
executes them, the encoder image balancer, and the per-sample count check.
"""

from .balance import ImageBalancer
from .balance_plan import BalancePlan, plan_balance
from .communicator import ColocatedBridgeCommunicator
from .counts import (
    ROW_SIZE,
    CountRow,
    check_sample_counts,
    count_mismatch_message,
    count_row,
    counts_agree,
    counts_fingerprint,
)
from .groups import BridgeGroups, make_bridge_groups, make_route_group, make_world_group
from .plan import BridgeDirection, BridgePlan, format_rank_table, plan_bridge
from .ragged import bridge_ragged, check_tokens_per_sample, exchange_rows
from .ragged_plan import RaggedRoute, check_member_headers, route_ragged
from .route import RouteCall, parse_route, route_image_rows, run_route
from .route_plan import (
    RankRoute,
    RouteCache,
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from .stage_plan import Piece, StageDelivery, Transfer, plan_stage_delivery

__all__ = [
    "BalancePlan",
    "ImageBalancer",
    "plan_balance",
    "ColocatedBridgeCommunicator",
    "ROW_SIZE",
    "CountRow",
    "check_sample_counts",
    "count_mismatch_message",
    "count_row",
    "counts_agree",
    "counts_fingerprint",
    "BridgeDirection",
    "BridgePlan",
    "format_rank_table",
    "plan_bridge",
    "bridge_ragged",
    "check_tokens_per_sample",
    "exchange_rows",
    "RaggedRoute",
    "check_member_headers",
    "route_ragged",
    "BridgeGroups",
    "make_bridge_groups",
    "RouteCall",
    "parse_route",
    "run_route",
    "make_route_group",
    "make_world_group",
    "route_image_rows",
    "Piece",
    "StageDelivery",
    "Transfer",
    "plan_stage_delivery",
    "RankRoute",
    "RouteCache",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
]
