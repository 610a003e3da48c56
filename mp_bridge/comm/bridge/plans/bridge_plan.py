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
(an LLM DP replica now spans its stages), and :mod:`~.stage` says which holder sends
each piece to each first-stage consumer, so later stages receive nothing.

The layouts' checks and direction are :mod:`~mp_bridge.comm.bridge.plans.layouts`; the
plan's gather and CP groups and its readable table :mod:`~mp_bridge.comm.bridge.plans.plan_groups`.
This module never imports ``torch.distributed``: everything is computed from coordinates,
so any ``axis_names`` order works whenever the two layouts nest, and it is unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.checks import check_bool, check_int
from mp_bridge.comm.bridge.plans.layouts import (
    BridgeDirection,
    as_layout,
    bridge_direction,
    check_layouts,
)
from mp_bridge.comm.bridge.plans.plan_groups import describe_plan, dest_cp_groups, gather_groups
from mp_bridge.grid import GridLayout

__all__ = ["BridgePlan", "plan_bridge"]


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
        return describe_plan(self)

    def __repr__(self) -> str:
        return (
            f"BridgePlan({self.src!r} -> {self.dest!r}, {self.direction.name}, "
            f"scale={self.scale}, cp={self.cp_size})"
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
    (:func:`~mp_bridge.comm.bridge.plans.stage.plan_stage_delivery`). Without it dest PP > 1
    is a ``ValueError``: the all-gather bridge would hand every stage encoder rows and
    give a later stage's encoder replica no gradient.
    """
    check_bool("pipeline", pipeline)
    src, dest = as_layout("src", src), as_layout("dest", dest)
    check_layouts(src, dest, src_name, dest_name)
    if dest.axis_size("pp") > 1 and not pipeline:
        raise ValueError(
            f"{dest_name} grid {dest!r} has pp={dest.axis_size('pp')}; only a caller that "
            f"delivers encoder rows to the first stage alone may bridge into a pipelined "
            f"{dest_name}: pass pipeline=True and use plan_stage_delivery(plan)"
        )
    direction, k = bridge_direction(src, dest, src_name, dest_name)
    return BridgePlan(
        src,
        dest,
        direction,
        k,
        gather_groups(src, dest, direction, k),
        dest_cp_groups(dest),
        src_name,
        dest_name,
    )
