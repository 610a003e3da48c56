"""Rank geometry (pure) and process-group creation on megatron-core's ``HyperCommGrid``."""

from .destroy import destroy_grid
from .layout import GridLayout
from .make import make_grid
from .spec import AXIS_NAMES, parse_layout_spec

__all__ = ["AXIS_NAMES", "GridLayout", "destroy_grid", "make_grid", "parse_layout_spec"]
