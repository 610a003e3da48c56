"""The colocated MIMO step: groups, flows (gather / routed), step checks and the model wrapper."""

from .build import build_colocated_mimo, destroy_colocated_mimo
from .flow import MimoFlow, packed_tokens
from .groups import MimoGroups, check_group, grid_group, make_mimo_groups
from .mimo import ColocatedMimoModel
from .routed import FLOWS, check_flow, place_local_rows, routed_forward
from .step_checks import agree_image_counts, check_batch, check_step

__all__ = [
    "build_colocated_mimo",
    "destroy_colocated_mimo",
    "MimoFlow",
    "packed_tokens",
    "MimoGroups",
    "check_group",
    "grid_group",
    "make_mimo_groups",
    "ColocatedMimoModel",
    "FLOWS",
    "check_flow",
    "place_local_rows",
    "routed_forward",
    "agree_image_counts",
    "check_batch",
    "check_step",
]
