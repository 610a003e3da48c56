"""Build a megatron-core ``HyperCommGrid`` on an initialized world and create its groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.checks import FrozenSpec, agree, agreed, check_int
from mp_bridge.deprecations import resolve_alias
from mp_bridge.grid.layout import GridLayout
from mp_bridge.grid.spec import AXIS_NAMES

__all__ = ["make_grid"]


# Groups created by default: every axis but pipeline (nothing in mp_bridge uses PP groups).
_DEFAULT_CREATE = tuple(a for a in AXIS_NAMES if a != "pp")


@dataclass(frozen=True)
class GridSpec(FrozenSpec):
    """What every rank of the world passes alike (group creation is collective)."""

    sizes: tuple[tuple[str, int], ...]
    axis_names: tuple[str, ...]
    rank_offset: int
    create: tuple[tuple[str, ...], ...]


@agreed("mp_bridge.grid.make_grid")
def make_grid(
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp: int = 1,
    *,
    rank_offset: int = 0,
    axis_names: Sequence[str] | None = None,
    dim_names: Sequence[str] | None = None,
    create: Sequence[str | Sequence[str]] | None = None,
    groups: Sequence[str | Sequence[str]] | None = None,
) -> HyperCommGrid:
    """A ``HyperCommGrid`` of the given sizes, ordered by ``axis_names``, with groups created.

    ``axis_names`` (default ``AXIS_NAMES``; ``dim_names=``, megatron's spelling, is a
    deprecated alias) orders the axes (first = fastest over ranks), e.g.
    ``("tp", "cp", "pp", "dp")`` (megatron's default) or ``("tp", "dp")``; axes it omits
    must have size 1.
    Each entry of ``create`` (alias ``groups``) is an axis name or
    a sequence of names (e.g. ``("dp", "cp")``); default: those of ``tp``, ``cp``, ``dp``
    that ``axis_names`` holds. Groups use the world's default backend (gloo on CPU, NCCL on
    CUDA); fetch them with ``grid.get_pg("tp")`` / ``grid.get_pg(["dp", "cp"])``.

    Collective: every rank of the world must call this with the same arguments, in the
    same order, even ranks outside the grid (group creation is global), or ranks hang.

    Example (8 ranks): ``make_grid(tp=2, cp=2, dp=2)`` puts ranks ``[0, 1]`` in a TP group
    and ``[0, 2]`` in a CP group; ``make_grid(tp=2, dp=2, rank_offset=4)`` covers ranks 4-7.
    """
    if create is not None and groups is not None:
        raise ValueError("pass either create= or its alias groups=, not both")
    if create is None:
        create = groups
    axis_names = resolve_alias(
        "mp_bridge.grid.make_grid(dim_names=...)", "axis_names", axis_names, "dim_names", dim_names
    )
    if axis_names is None:
        axis_names = AXIS_NAMES
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "make_grid needs an initialized torch.distributed world; call "
            "torch.distributed.init_process_group first (or use mp_bridge.testing.run_distributed)"
        )
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    for axis, size in sizes.items():  # name the argument, before any collective
        sizes[axis] = check_int(axis, size, low=1, fix=f"the make_grid {axis} size (1 = no split)")
    names = tuple(axis_names)
    unknown = [n for n in names if n not in sizes]
    if unknown:
        raise ValueError(
            f"axis_names={names} has unknown axes {unknown}; use names from {AXIS_NAMES}"
        )
    dropped = [n for n, size in sizes.items() if n not in names and size != 1]
    if dropped:
        raise ValueError(
            f"axis_names={names} omits {dropped}, whose sizes are not 1; add them to axis_names"
        )
    layout = GridLayout(tuple(sizes[n] for n in names), names, rank_offset)  # validates sizes
    world = dist.get_world_size()
    if layout.size + rank_offset > world:
        raise ValueError(
            f"grid tp={tp} cp={cp} pp={pp} dp={dp} needs {layout.size} ranks from "
            f"rank_offset={rank_offset}, but the world has only {world}; shrink the grid or "
            f"launch at least {layout.size + rank_offset} ranks"
        )
    if create is None:
        create = tuple(n for n in _DEFAULT_CREATE if n in names)
    if isinstance(create, str):
        create = (create,)
    to_create = [[c] if isinstance(c, str) else list(c) for c in create]
    for axes in to_create:
        layout.groups(axes)  # validates names before any collective
    # Group creation is collective over the world: ranks given different grids would hang.
    spec = GridSpec(
        tuple(sizes.items()), names, layout.rank_offset, tuple(tuple(a) for a in to_create)
    )
    agree("make_grid", dist.group.WORLD, spec)
    grid = HyperCommGrid(list(layout.shape), list(names), rank_offset=rank_offset)
    for axes in to_create:
        grid.create_pg(axes if len(axes) > 1 else axes[0])
    return grid
