"""The bridge's execution: process groups and the collectives that run the pure plans.

``communicator``: :class:`ColocatedBridgeCommunicator`, the one door (one entry guard and
one agreement per public call); ``bridge_groups``: the groups it makes; ``dense``,
``ragged``, ``route``, ``balanced_route``, ``stage``: one execution per plan;
``row_move``: the one row move they run (``all_to_all_single`` in one place, ragged's
counted byte message aside) and its two autograd Functions, one per kind of adjoint;
``headers``: the fixed-size header all-gather; ``sample_counts``: the per-sample count check over
every rank; ``balancer``: :class:`ImageBalancer`, which moves whole images between encoder
DP replicas; ``call_specs``: what the ranks of a call compare; ``names``: the
communicator's module names.
"""

from .balancer import ImageBalancer
from .bridge_groups import BridgeGroups, make_bridge_groups, make_route_group, make_world_group
from .communicator import ColocatedBridgeCommunicator
from .ragged import bridge_ragged, exchange_rows
from .route import RouteCall, parse_route, run_route
from .sample_counts import check_sample_counts

__all__ = [
    "ImageBalancer",
    "BridgeGroups",
    "make_bridge_groups",
    "make_route_group",
    "make_world_group",
    "ColocatedBridgeCommunicator",
    "bridge_ragged",
    "exchange_rows",
    "RouteCall",
    "parse_route",
    "run_route",
    "check_sample_counts",
]
