"""The colocated bridge, in two halves: pure plans and their execution.

- :mod:`~mp_bridge.comm.bridge.plans`: who sends which rows to whom (dense, ragged,
  routed, pipeline stages, image balance, the per-sample count rows), computed from two
  grid layouts with no process group.
- :mod:`~mp_bridge.comm.bridge.execution`: the communicator that runs them with process
  groups and autograd-aware collectives, the image balancer, and the count check.
- :class:`Bridge` (:mod:`.bridge_protocol`): what a model asks of a bridge; the
  communicator and :class:`LocalBridge` (:mod:`.local_bridge`, one process) are its two.

Checked and trusted entries are spelled one way: ``f`` validates its arguments and
``f_trusted`` is the same step on arguments its caller already checked (the communicator's
path: :func:`parse_route` / ``parse_route_trusted``, :func:`route_ragged` /
``route_ragged_trusted``, :func:`exchange_rows` / ``exchange_rows_trusted``).

Every name is re-exported here (and the public ones again from :mod:`mp_bridge.comm`).
"""

from .bridge_protocol import Bridge
from .execution import (
    BridgeGroups,
    ColocatedBridgeCommunicator,
    ImageBalancer,
    RouteCall,
    bridge_ragged,
    check_sample_counts,
    exchange_rows,
    make_bridge_groups,
    make_route_group,
    make_world_group,
    parse_route,
    run_route,
)
from .local_bridge import LocalBridge
from .plans import (
    ROW_SIZE,
    BalancePlan,
    BridgeDirection,
    BridgePlan,
    CountRow,
    MoveLeg,
    Piece,
    PlanCache,
    RaggedRoute,
    RankRoute,
    RouteCache,
    RowMove,
    StageDelivery,
    Transfer,
    check_member_headers,
    check_tokens_per_sample,
    count_mismatch_message,
    count_row,
    counts_agree,
    counts_fingerprint,
    format_rank_table,
    image_token_shards,
    plan_balance,
    plan_bridge,
    plan_route,
    plan_stage_delivery,
    route_groups,
    route_needs,
    route_ragged,
)

__all__ = [
    "Bridge",
    "LocalBridge",
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
    "MoveLeg",
    "RowMove",
    "Piece",
    "StageDelivery",
    "Transfer",
    "plan_stage_delivery",
    "RankRoute",
    "PlanCache",
    "RouteCache",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
]
