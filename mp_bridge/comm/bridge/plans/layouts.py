"""Whether two grid layouts can be bridged, and how: the direction and the DP ratio.

Pure (no process group): the checks every bridge plan starts from. A colocated bridge
needs both grids on the same ranks, ``tp``/``dp`` axes, src CP = PP = 1, DP sizes that
divide one another, and layouts that *nest*: with ``k`` the DP ratio, every rank's src
and dest DP coordinates satisfy FAN_IN ``src_dp // k == dest_dp``, FAN_OUT
``dest_dp // k == src_dp``, EQUAL ``src_dp == dest_dp``.

Example: encoder ``tp=2,dp=4`` -> LLM ``tp=2,cp=2,dp=2`` is FAN_IN with ``k = 2``:
``bridge_direction(src, dest) == (BridgeDirection.FAN_IN, 2)``.
"""

from __future__ import annotations

import enum

from mp_bridge.grid import AXIS_NAMES, GridLayout

__all__ = ["BridgeDirection", "as_layout", "bridge_direction", "check_layouts", "nesting_error"]


class BridgeDirection(enum.Enum):
    """How the DP sizes relate: ``dp_src = k·dp_dest`` (FAN_IN), the reverse, or equal."""

    FAN_IN = "fan_in"
    FAN_OUT = "fan_out"
    EQUAL = "equal"

    def __repr__(self) -> str:
        return f"BridgeDirection.{self.name}"


def as_layout(arg: str, layout: object) -> GridLayout:
    """``layout`` itself, or the GridLayout of a megatron ``HyperCommGrid`` (duck-typed)."""
    if isinstance(layout, GridLayout):
        return layout
    if all(hasattr(layout, a) for a in ("shape", "dim_names", "rank_offset")):
        return GridLayout.from_grid(layout)  # megatron's own spelling, not our alias
    raise TypeError(
        f"{arg} must be a GridLayout or a HyperCommGrid (GridLayout.from_grid converts one), "
        f"got {type(layout).__name__}"
    )


def check_layouts(src: GridLayout, dest: GridLayout, src_name: str, dest_name: str) -> None:
    if src.size != dest.size or src.rank_offset != dest.rank_offset:
        raise ValueError(
            f"{src_name} {src!r} covers ranks [{src.ranks.start}, {src.ranks.stop}) but "
            f"{dest_name} {dest!r} covers [{dest.ranks.start}, {dest.ranks.stop}); a colocated "
            f"bridge needs both grids on the same ranks (same size and rank_offset)"
        )
    for name, layout in ((src_name, src), (dest_name, dest)):
        missing = [a for a in ("tp", "dp") if a not in layout.axis_names]
        if missing:
            raise ValueError(
                f"{name} grid {layout!r} has no axis {missing}; name it (size 1 is fine), "
                f"e.g. axis_names=('tp', 'cp', 'pp', 'dp')"
            )
        unknown = [
            f"{n}={s}"
            for n, s in zip(layout.axis_names, layout.shape)
            if n not in AXIS_NAMES and s > 1
        ]
        if unknown:
            raise ValueError(
                f"{name} grid {layout!r} has axes {unknown} the bridge does not understand; "
                f"only {list(AXIS_NAMES)} may have size > 1"
            )
    if src.axis_size("pp") > 1:
        raise ValueError(
            f"{src_name} grid {src!r} has pp={src.axis_size('pp')}; the encoder runs whole on "
            f"every rank (src pp=1 only); pipeline the {dest_name} grid instead (its pp axis)"
        )
    if src.axis_size("cp") > 1:
        raise ValueError(
            f"{src_name} grid {src!r} has cp={src.axis_size('cp')}; the bridge input must hold "
            f"full sequences (src cp=1); shard the sequence on the {dest_name} side instead"
        )
    dps, dpd = src.axis_size("dp"), dest.axis_size("dp")
    if dps % dpd and dpd % dps:
        raise ValueError(
            f"{src_name} dp={dps} and {dest_name} dp={dpd} do not divide one another; "
            f"choose DP sizes where one is a multiple of the other"
        )


def nesting_error(
    rank: int, src: GridLayout, dest: GridLayout, rule: str, src_name: str, dest_name: str
) -> ValueError:
    return ValueError(
        f"layouts do not nest: rank {rank} has {src_name} coords {src.coords(rank)} and "
        f"{dest_name} coords {dest.coords(rank)}, but the bridge needs {rule}, so this rank "
        f"would receive another replica's samples (got {src_name} axis_names={src.axis_names}, "
        f"{dest_name} axis_names={dest.axis_names}). Order the axes so DP blocks line up, "
        f"e.g. dp slowest in both grids: {src_name} ('tp', 'dp'), {dest_name} "
        f"('tp', 'cp', 'pp', 'dp')"
    )


def bridge_direction(
    src: GridLayout, dest: GridLayout, src_name: str = "src", dest_name: str = "dest"
) -> tuple[BridgeDirection, int]:
    """``(direction, k)`` of two checked layouts (:func:`check_layouts`), after checking
    for every rank that they nest; ``ValueError`` naming the first rank that does not."""
    dps, dpd = src.axis_size("dp"), dest.axis_size("dp")
    if dps > dpd:
        direction, k = BridgeDirection.FAN_IN, dps // dpd
        rule = f"{src_name} dp // {k} == {dest_name} dp"
        nests = lambda s, d: s["dp"] // k == d["dp"]
    elif dpd > dps:
        direction, k = BridgeDirection.FAN_OUT, dpd // dps
        rule = f"{dest_name} dp // {k} == {src_name} dp"
        nests = lambda s, d: d["dp"] // k == s["dp"]
    else:
        direction, k = BridgeDirection.EQUAL, 1
        rule = f"{src_name} dp == {dest_name} dp"
        nests = lambda s, d: s["dp"] == d["dp"]
    for r in src.ranks:
        if not nests(src.coords(r), dest.coords(r)):
            raise nesting_error(r, src, dest, rule, src_name, dest_name)
    return direction, k
