"""Every process group a colocated MIMO model uses, built in one explicit step.

:func:`make_mimo_groups` is the only place a colocated model's groups are created: the
grids' axis groups it needs (created on the grids with ``create_pg`` when missing, so the
grids own them) and the bridge (which owns its gather groups and takes its dest CP group
from ``llm_grid``). :meth:`MimoGroups.destroy` mirrors it: the bridge first, then every
group of both grids. Models only receive groups.

Groups used, per rank (axes a grid does not name have size 1 and give ``None``):

============  ==============  ==================================================
field         grid, axes      used by
============  ==============  ==================================================
encoder_tp    encoder ``tp``  encoder and projection linears, image agreement
encoder_dp    encoder ``dp``  encoder gradient sync, image agreement
llm_tp        llm ``tp``      vocab layers, linears, loss, SP norms' gradient sync
llm_cp        llm ``cp``      CP attention, partition adapter, bridge backward
llm_dp_cp     llm ``dp, cp``  loss denominator, LLM gradient sync
============  ==============  ==================================================

Example (8 ranks, ``encoder_grid = make_grid(tp=2, dp=4)``, ``llm_grid = make_grid(tp=2,
cp=2, dp=2)``): rank 5 gets ``encoder_tp`` ``[4, 5]``, ``encoder_dp`` ``[1, 3, 5, 7]``,
``llm_tp`` ``[4, 5]``, ``llm_cp`` ``[5, 7]``, ``llm_dp_cp`` ``[1, 3, 5, 7]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, plan_bridge
from mp_bridge.grid import MISSING_PG_ERRORS, GridLayout, destroy_grid

__all__ = ["MimoGroups", "check_group", "grid_group", "make_mimo_groups"]

#: Field of :class:`MimoGroups` -> the axes of its grid it spans.
ENCODER_AXES = {"encoder_tp": ("tp",), "encoder_dp": ("dp",)}
LLM_AXES = {"llm_tp": ("tp",), "llm_cp": ("cp",), "llm_dp_cp": ("dp", "cp")}


def check_group(group: object, name: str) -> None:
    """``TypeError`` unless ``group`` is a ``ProcessGroup`` or ``None`` (one process)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name}={group!r} must be a torch.distributed ProcessGroup or None "
            "(None = a single process); pass grid.get_pg('tp') or a MimoGroups field"
        )


def grid_group(grid: Any, axes: Sequence[str], *, create: bool = False):
    """This rank's group of ``grid`` over ``axes`` (megatron ``HyperCommGrid``).

    Axes the grid does not name are dropped (size 1); ``None`` if none is left. A group
    the grid lacks is created with ``grid.create_pg`` when ``create`` (collective over the
    world: every rank calls it in the same order), else ``ValueError`` naming the fix.
    ``None`` is also what megatron returns on a rank outside the grid.
    """
    present = [a for a in axes if a in tuple(grid.dim_names)]
    if not present:
        return None
    key = present[0] if len(present) == 1 else present
    try:
        return grid.get_pg(key)
    except MISSING_PG_ERRORS:  # the error type differs by megatron-core version
        if create:
            return grid.create_pg(key)
    raise ValueError(
        f"grid {list(grid.dim_names)} {list(grid.shape)} has no {key!r} process group; "
        f"create it with make_grid(..., create=[..., {key!r}]) or build every group with "
        "make_mimo_groups(encoder_grid, llm_grid)"
    )


@dataclass(frozen=True)
class MimoGroups:
    """This rank's groups of a colocated model (see the module table) and its bridge.

    Built by :func:`make_mimo_groups`; freed by :meth:`destroy` (collective, every rank).
    """

    encoder_grid: Any
    llm_grid: Any
    bridge: ColocatedBridgeCommunicator
    encoder_tp: dist.ProcessGroup | None
    encoder_dp: dist.ProcessGroup | None
    llm_tp: dist.ProcessGroup | None
    llm_cp: dist.ProcessGroup | None
    llm_dp_cp: dist.ProcessGroup | None

    def destroy(self) -> None:
        """Free the bridge's groups, then every group of both grids (idempotent).

        Collective like :func:`make_mimo_groups`: every rank of the world calls it.
        """
        self.bridge.destroy()
        destroy_grid(self.llm_grid)
        destroy_grid(self.encoder_grid)


def make_mimo_groups(encoder_grid: Any, llm_grid: Any) -> MimoGroups:
    """Create (or reuse) every group a colocated model on these grids needs.

    ``encoder_grid`` (``tp`` x ``dp``) and ``llm_grid`` (``tp`` x ``cp`` x ``dp``) are
    megatron ``HyperCommGrid`` s (``make_grid``) on the same ranks. Groups they already hold
    are reused; missing ones are created on them (``create_pg``), encoder grid first, in
    the order of the module table; then the bridge is built. The layouts are checked
    (``plan_bridge``) before any collective.

    Collective: every rank of the world calls it with the same grids, in the same order
    as its other group creations, even ranks outside the grids.
    """
    for name, grid in (("encoder_grid", encoder_grid), ("llm_grid", llm_grid)):
        if not all(hasattr(grid, a) for a in ("get_pg", "create_pg", "dim_names", "shape")):
            raise TypeError(
                f"{name} must be a megatron HyperCommGrid (make_grid returns one), got "
                f"{type(grid).__name__}; a GridLayout holds no process groups"
            )
    plan_bridge(GridLayout.from_grid(encoder_grid), GridLayout.from_grid(llm_grid))
    groups = {
        field: grid_group(grid, axes, create=True)
        for grid, table in ((encoder_grid, ENCODER_AXES), (llm_grid, LLM_AXES))
        for field, axes in table.items()
    }
    bridge = ColocatedBridgeCommunicator(encoder_grid, llm_grid)
    return MimoGroups(encoder_grid, llm_grid, bridge, **groups)
