"""The colocated MIMO step: groups, the parse-and-agree door, the flows (gather / routed)
and the model wrapper."""

from mp_bridge.comm import LocalBridge

from .build import build_colocated_mimo, destroy_colocated_mimo
from .gather import GatherFlow
from .mimo import ColocatedMimoModel
from .mimo_groups import MimoGroups, check_members, grid_group, groups_of_bridge, make_mimo_groups
from .mimo_options import FLOWS, MimoOptions, parse_flow
from .parts import Microbatch, MimoFlow, StageFeed, StepParts, shard_loss
from .routed import RoutedFlow, place_local_rows
from .step_agreement import ReplicaDocsSpec, StepSpec, agree_image_counts, agree_step_inputs

__all__ = [
    "MimoOptions",
    "ReplicaDocsSpec",
    "StepSpec",
    "agree_image_counts",
    "agree_step_inputs",
    "build_colocated_mimo",
    "destroy_colocated_mimo",
    "FLOWS",
    "parse_flow",
    "GatherFlow",
    "MimoGroups",
    "check_members",
    "grid_group",
    "groups_of_bridge",
    "make_mimo_groups",
    "LocalBridge",
    "ColocatedMimoModel",
    "Microbatch",
    "MimoFlow",
    "StageFeed",
    "StepParts",
    "shard_loss",
    "RoutedFlow",
    "place_local_rows",
]
