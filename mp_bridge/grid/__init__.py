"""Rank geometry (pure) and process-group creation on megatron-core's ``HyperCommGrid``."""

from mp_bridge.grid.destroy import destroy_grid
from mp_bridge.grid.layout import GridLayout
from mp_bridge.grid.make import make_grid
from mp_bridge.grid.megatron_compat import MISSING_PG_ERRORS, get_pg_or_none
from mp_bridge.grid.spec import AXIS_NAMES, parse_layout_spec

__all__ = [
    "AXIS_NAMES",
    "MISSING_PG_ERRORS",
    "GridLayout",
    "destroy_grid",
    "get_pg_or_none",
    "make_grid",
    "parse_layout_spec",
]
