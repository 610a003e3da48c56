"""Build a megatron-core ``HyperCommGrid`` on an initialized world and create its groups."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

from .layout import GridLayout
from .spec import AXIS_NAMES

__all__ = ["make_grid"]


def make_grid(
    *,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp: int = 1,
    rank_offset: int = 0,
    dim_names: Sequence[str] = AXIS_NAMES,
    create: Sequence[str | Sequence[str]] = ("tp", "cp", "dp"),
) -> HyperCommGrid:
    """A ``HyperCommGrid`` of shape ``(tp, cp, pp, dp)`` ordered by ``dim_names``.

    ``dim_names`` is a permutation of ``("tp", "cp", "pp", "dp")`` (first = fastest over
    ranks). Each entry of ``create`` is an axis name or a sequence of names (e.g.
    ``("dp", "cp")``); its groups are created with the world's default backend (gloo on
    CPU, NCCL on CUDA). Collective: every rank of the world must call this with the same
    arguments, in the same order, even ranks outside the grid (group creation is global).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "make_grid needs an initialized torch.distributed world; call "
            "torch.distributed.init_process_group first (or use mp_bridge.testing.run_distributed)"
        )
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    names = tuple(dim_names)
    if sorted(names) != sorted(AXIS_NAMES):
        raise ValueError(f"dim_names={names} must be a permutation of {AXIS_NAMES}")
    layout = GridLayout(tuple(sizes[n] for n in names), names, rank_offset)  # validates sizes
    world = dist.get_world_size()
    if layout.size + rank_offset > world:
        raise ValueError(
            f"grid tp={tp} cp={cp} pp={pp} dp={dp} needs {layout.size} ranks from "
            f"rank_offset={rank_offset}, but the world has only {world}; shrink the grid or "
            f"launch at least {layout.size + rank_offset} ranks"
        )
    groups = [[c] if isinstance(c, str) else list(c) for c in create]
    for dims in groups:
        layout.groups(dims)  # validates names before any collective
    grid = HyperCommGrid(list(layout.shape), list(names), rank_offset=rank_offset)
    for dims in groups:
        grid.create_pg(dims if len(dims) > 1 else dims[0])
    return grid
