"""The bridge's pure plans: who sends which rows to whom, from two grid layouts.

No module here imports ``torch.distributed`` (``tests/unit/test_architecture.py`` checks
it): every plan is a frozen value computed from coordinates, unit-testable with no process
group. ``layouts``: whether two layouts bridge (direction, DP ratio, nesting);
``bridge_plan``: :class:`BridgePlan` and :func:`plan_bridge`; ``plan_groups``: the base
plan's gather and CP groups and its readable table; ``ragged``, ``token_counts``: the
ragged step and its per-sample counts; ``route``: the routed rows; ``stage``:
delivery to a pipelined LLM's first stage; ``balance_plan``: the encoder image balance;
``count_rows``: the per-sample count rows every rank compares; ``plan_cache``: the LRU of
route and balance plans; ``row_move``: :class:`RowMove`, which rows go where forward and
backward, the one type the route, stage, balance and ragged plans produce.
"""

from .balance_plan import BalancePlan, ImageMove, image_costs, plan_balance
from .bridge_plan import BridgePlan, plan_bridge
from .count_rows import (
    ROW_SIZE,
    CountRow,
    count_mismatch_message,
    count_row,
    counts_agree,
    counts_fingerprint,
)
from .layouts import BridgeDirection
from .plan_cache import PlanCache, RouteCache
from .plan_groups import format_rank_table
from .ragged import RaggedRoute, check_member_headers, route_ragged
from .route import (
    RankRoute,
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from .row_move import MoveLeg, RowMove, gather_move
from .stage import Piece, StageDelivery, Transfer, plan_stage_delivery
from .token_counts import check_tokens_per_sample

__all__ = [
    "BalancePlan",
    "ImageMove",
    "image_costs",
    "plan_balance",
    "BridgePlan",
    "plan_bridge",
    "ROW_SIZE",
    "CountRow",
    "count_mismatch_message",
    "count_row",
    "counts_agree",
    "counts_fingerprint",
    "format_rank_table",
    "BridgeDirection",
    "RaggedRoute",
    "check_member_headers",
    "route_ragged",
    "RankRoute",
    "PlanCache",
    "RouteCache",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
    "MoveLeg",
    "RowMove",
    "gather_move",
    "Piece",
    "StageDelivery",
    "Transfer",
    "plan_stage_delivery",
    "check_tokens_per_sample",
]
