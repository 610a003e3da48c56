"""Who talks to whom in the colocated bridge: a pure plan from two grid layouts.

The bridge moves an activation from the encoder (src) layout TP×DP to the LLM (dest)
layout TP×CP×PP×DP on the same ranks. The global batch is split over DP in contiguous blocks
by DP index in both grids, and the input is TP-replicated inside a src DP replica. With
``k`` the DP ratio, each rank's dest shard is either the concatenation of ``k`` src shards
(FAN_IN: one all-gather) or one ``1/k`` slot of its src shard (FAN_OUT: a local narrow).

Example, encoder ``tp=2,dp=4`` -> LLM ``tp=2,cp=2,dp=2`` (tp fastest in both):
FAN_IN with scale 2; rank 0 (src dp 0) and rank 2 (src dp 1) both feed LLM replica 0, so
``gather_group_of(0) == (0, 2)`` and ``slice_for(2, batch_size=4) == (2, 2)``.

With LLM PP > 1 (``pipeline=True``; the encoder keeps PP = 1 over all ranks) only the
LLM's first stage consumes encoder rows; the gather groups and nesting rule are unchanged
(an LLM DP replica now spans its stages), and :mod:`mp_bridge.comm.bridge.stage_plan` says which
holder sends each piece to each first-stage consumer, so later stages receive nothing.

This module never imports ``torch.distributed``: everything is computed from coordinates,
so any ``axis_names`` order works whenever the two layouts nest, and it is unit-testable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mp_bridge.checks import check_bool, check_int
from mp_bridge.grid import AXIS_NAMES, GridLayout
from mp_bridge.table import format_table

__all__ = ["BridgeDirection", "BridgePlan", "format_rank_table", "plan_bridge"]


class BridgeDirection(enum.Enum):
    """How the DP sizes relate: ``dp_src = k·dp_dest`` (FAN_IN), the reverse, or equal."""

    FAN_IN = "fan_in"
    FAN_OUT = "fan_out"
    EQUAL = "equal"

    def __repr__(self) -> str:
        return f"BridgeDirection.{self.name}"


@dataclass(frozen=True)
class BridgePlan:
    """The bridge between ``src`` and ``dest`` layouts: direction, scale and groups.

    - ``gather_groups``: FAN_IN one group per (dest dp j, src tp t): the ``scale`` ranks
      with src dp in ``[j·k, j·k+k)`` and src tp ``t``, ordered by src dp. FAN_OUT one per
      (src dp i, dest tp t, dest cp c, dest pp p): the ranks with dest dp in
      ``[i·k, i·k+k)``, ordered
      by dest dp. EQUAL: one single-rank group per rank (``scale == 1``; nothing to
      gather, no process group is created). Every rank sits in exactly one group of
      ``scale`` members. Member order is the concatenation order of the batch pieces (it
      is also ascending rank, i.e. process-group rank order).
    - ``cp_groups``: the dest CP groups (single ranks when dest CP = 1), whose all-reduce
      rebuilds the full-sequence gradient in backward.
    """

    src: GridLayout
    dest: GridLayout
    direction: BridgeDirection
    scale: int
    gather_groups: tuple[tuple[int, ...], ...]
    cp_groups: tuple[tuple[int, ...], ...]
    src_name: str = "src"
    dest_name: str = "dest"

    @property
    def cp_size(self) -> int:
        """Dest CP size (1 means no CP all-reduce in backward)."""
        return self.dest.axis_size("cp")

    @property
    def pp_size(self) -> int:
        """Dest PP size: the LLM's pipeline stages (only stage 0 consumes encoder rows)."""
        return self.dest.axis_size("pp")

    def stage_of(self, rank: int) -> int:
        """``rank``'s LLM pipeline stage (0 when dest PP = 1)."""
        self._check_rank(rank)
        return self.dest.coords(rank).get("pp", 0)

    def consumes(self, rank: int) -> bool:
        """Whether ``rank`` consumes encoder outputs: it sits on the LLM's first stage."""
        return self.stage_of(rank) == 0

    def _check_rank(self, rank: int) -> None:
        self.src.coords(rank)  # raises a ValueError naming the valid range

    def check_member(self, rank: int, call: str) -> None:
        """``ValueError`` unless ``rank`` is one of the bridged ranks (the one membership
        check: every entry point that needs this rank's coordinates calls it first)."""
        if rank not in self.src.ranks:
            raise ValueError(
                f"rank {rank} is outside the bridged grids {self.src!r}; call {call} only on "
                f"ranks {list(self.src.ranks)}"
            )

    def gather_group_of(self, rank: int) -> tuple[int, ...]:
        """Members of ``rank``'s gather group in concatenation order (``(rank,)`` if EQUAL)."""
        self._check_rank(rank)
        return next(g for g in self.gather_groups if rank in g)

    def cp_group_of(self, rank: int) -> tuple[int, ...]:
        """Members of ``rank``'s dest CP group (``(rank,)`` when dest CP = 1)."""
        self._check_rank(rank)
        return next(g for g in self.cp_groups if rank in g)

    def slot_of(self, rank: int) -> int:
        """``rank``'s position in its gather group: src dp mod k (FAN_IN), dest dp mod k."""
        return self.gather_group_of(rank).index(rank)

    def slice_for(self, rank: int, batch_size: int) -> tuple[int, int]:
        """``(start, size)`` of ``rank``'s piece of the batch its gather group spans.

        ``batch_size`` is the larger local batch: FAN_IN the gathered dest batch (the piece
        is this rank's own src shard), FAN_OUT the src batch (the piece is this rank's dest
        shard), EQUAL the local batch (the piece is all of it). E.g. FAN_IN scale 2, slot 1:
        ``slice_for(rank, 4) == (2, 2)``.
        """
        check_int("batch_size", batch_size, low=0)
        if batch_size % self.scale:
            raise ValueError(
                f"batch_size={batch_size} is not divisible by the bridge scale {self.scale} "
                f"({self.direction.name}); use a multiple of {self.scale}"
            )
        size = batch_size // self.scale
        return self.slot_of(rank) * size, size

    def describe(self) -> str:
        """A readable table: direction, scale, and per rank its coords and groups."""
        k, cp = self.scale, self.cp_size
        steps = {
            BridgeDirection.FAN_IN: (
                f"all-gather along batch in gather group ({k} ranks)",
                "narrow to this rank's slot",
            ),
            BridgeDirection.FAN_OUT: (
                f"narrow to slot dest_dp mod {k}",
                f"all-gather along batch in gather group ({k} ranks)",
            ),
            BridgeDirection.EQUAL: ("identity", "identity"),
        }[self.direction]
        bwd = (f"all-reduce(SUM) over dest CP group ({cp} ranks), then " if cp > 1 else "") + steps[
            1
        ]
        head = [
            f"bridge {self.src_name} {self.src!r} -> {self.dest_name} {self.dest!r}",
            f"direction {self.direction.name}, scale {k}, dest cp {cp}",
            f"forward:  {steps[0]}",
            f"backward: {bwd}",
            "",
        ]
        table = format_rank_table(
            self.src,
            self.dest,
            self.src_name,
            self.dest_name,
            columns=(
                ("slot", lambda r: str(self.slot_of(r))),
                ("gather group", lambda r: _fmt_group(self.gather_group_of(r))),
                ("cp group", lambda r: _fmt_group(self.cp_group_of(r))),
            ),
        )
        return "\n".join(head) + "\n" + table

    def __repr__(self) -> str:
        return (
            f"BridgePlan({self.src!r} -> {self.dest!r}, {self.direction.name}, "
            f"scale={self.scale}, cp={self.cp_size})"
        )


def format_rank_table(
    src: GridLayout,
    dest: GridLayout,
    src_name: str = "src",
    dest_name: str = "dest",
    *,
    columns: Sequence[tuple[str, Callable[[int], str]]] = (),
) -> str:
    """One row per rank of ``src``: its coords in both layouts (axes of size > 1), then
    one cell per ``(header, cell_of_rank)`` in ``columns``. Pure text, aligned columns::

        rank  encoder    llm             slot
        ----  ---------  --------------  ----
        0     tp=0,dp=0  tp=0,cp=0,dp=0  0
    """
    rows = [("rank", src_name, dest_name, *(h for h, _ in columns))]
    for r in src.ranks:
        rows.append(
            (str(r), _fmt_coords(src, r), _fmt_coords(dest, r), *(f(r) for _, f in columns))
        )
    return format_table(rows)


def _fmt_coords(layout: GridLayout, rank: int) -> str:
    c = layout.coords(rank)
    shown = [f"{n}={c[n]}" for n, s in zip(layout.axis_names, layout.shape) if s > 1]
    return ",".join(shown) or "-"


def _fmt_group(group: tuple[int, ...]) -> str:
    return "[" + ",".join(str(r) for r in group) + "]"


def _as_layout(arg: str, layout: object) -> GridLayout:
    """``layout`` itself, or the GridLayout of a megatron ``HyperCommGrid`` (duck-typed)."""
    if isinstance(layout, GridLayout):
        return layout
    if all(hasattr(layout, a) for a in ("shape", "dim_names", "rank_offset")):
        return GridLayout.from_grid(layout)  # megatron's own spelling, not our alias
    raise TypeError(
        f"{arg} must be a GridLayout or a HyperCommGrid (GridLayout.from_grid converts one), "
        f"got {type(layout).__name__}"
    )


def _validate(src: GridLayout, dest: GridLayout, src_name: str, dest_name: str) -> None:
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


def _nesting_error(
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


def plan_bridge(
    src: GridLayout,
    dest: GridLayout,
    *,
    src_name: str = "src",
    dest_name: str = "dest",
    pipeline: bool = False,
) -> BridgePlan:
    r"""Plan the bridge from ``src`` (TP×DP) to ``dest`` (TP×CP×PP×DP) on the same ranks.

    ``src`` and ``dest`` are :class:`GridLayout`\ s (a ``HyperCommGrid`` is read with
    ``GridLayout.from_grid``; no process group is touched).

    Raises ``ValueError`` (before any group exists) when: the grids cover different ranks;
    ``tp``/``dp`` axes are missing; src CP > 1; src PP > 1; the DP sizes do not
    divide one another; or the layouts do not nest (checked for every rank: FAN_IN
    ``src_dp // k == dest_dp``, FAN_OUT ``dest_dp // k == src_dp``, EQUAL equal), naming the
    first offending rank with both coordinate sets.

    ``pipeline=True`` admits dest PP > 1: the caller then delivers to the first stage only
    (:func:`~mp_bridge.comm.bridge.stage_plan.plan_stage_delivery`). Without it dest PP > 1
    is a ``ValueError``: the all-gather bridge would hand every stage encoder rows and
    give a later stage's encoder replica no gradient.
    """
    check_bool("pipeline", pipeline)
    src, dest = _as_layout("src", src), _as_layout("dest", dest)
    _validate(src, dest, src_name, dest_name)
    if dest.axis_size("pp") > 1 and not pipeline:
        raise ValueError(
            f"{dest_name} grid {dest!r} has pp={dest.axis_size('pp')}; only a caller that "
            f"delivers encoder rows to the first stage alone may bridge into a pipelined "
            f"{dest_name}: pass pipeline=True and use plan_stage_delivery(plan)"
        )
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
            raise _nesting_error(r, src, dest, rule, src_name, dest_name)

    # Groups keyed by who they serve; members sorted by the dp coordinate that orders the
    # concatenation (FAN_IN src dp, FAN_OUT dest dp).
    buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    if direction is BridgeDirection.FAN_IN:
        for r in src.ranks:
            s = src.coords(r)
            buckets.setdefault((s["dp"] // k, s["tp"]), []).append((s["dp"], r))
    elif direction is BridgeDirection.FAN_OUT:
        for r in dest.ranks:
            d = dest.coords(r)
            key = (d["dp"] // k, d["tp"], d.get("cp", 0), d.get("pp", 0))
            buckets.setdefault(key, []).append((d["dp"], r))
    else:  # EQUAL: each rank is its own (trivial) gather group, like cp_groups at cp=1
        for r in src.ranks:
            buckets[(r,)] = [(0, r)]
    gather_groups = tuple(tuple(r for _, r in sorted(buckets[key])) for key in sorted(buckets))
    if "cp" in dest.axis_names:
        cp_groups = tuple(tuple(g) for g in dest.groups("cp"))
    else:
        cp_groups = tuple((r,) for r in dest.ranks)
    return BridgePlan(src, dest, direction, k, gather_groups, cp_groups, src_name, dest_name)
