"""make_grid inside an 8-rank world: groups hold exactly the ranks GridLayout predicts."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.grid.megatron_compat import MISSING_PG_ERRORS
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(8)


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _check_grid(kwargs, dims_list):
    grid = make_grid(**kwargs, create=dims_list)
    layout = GridLayout.from_grid(grid)
    rank = dist.get_rank()
    for dims in dims_list:
        predicted = layout.group_of(rank, dims)
        assert _members(grid.get_pg(list(dims) if not isinstance(dims, str) else dims)) == sorted(
            predicted
        ), (dims, predicted)
    return layout


@world.case
def test_default_order_groups():
    layout = _check_grid(dict(tp=2, cp=2, dp=2), ["tp", "cp", "dp", ("dp", "cp")])
    assert layout.dim_names == ("tp", "cp", "pp", "dp")


@world.case
def test_custom_order_groups():
    _check_grid(dict(tp=2, dp=4, dim_names=("dp", "tp", "cp", "pp")), ["tp", "dp"])


@world.case
def test_offset_grid_on_part_of_the_world():
    # Every rank of the world takes part in group creation, even those outside the grid.
    grid = make_grid(tp=2, dp=2, rank_offset=4, create=["tp"])
    layout = GridLayout.from_grid(grid)
    if dist.get_rank() >= 4:
        assert _members(grid.get_pg("tp")) == layout.group_of(dist.get_rank(), "tp")


@world.case
def test_world_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs 16 ranks .* world has only 8"):
        make_grid(tp=2, dp=8)
    with pytest.raises(ValueError, match=r"omits \['cp'\], whose sizes are not 1"):
        make_grid(tp=2, cp=2, dim_names=("tp", "dp"))
    with pytest.raises(ValueError, match=r"unknown axes \['ep'\]"):
        make_grid(tp=2, dim_names=("tp", "ep"))
    with pytest.raises(ValueError, match="not both"):
        make_grid(tp=2, create=["tp"], groups=["tp"])
    with pytest.raises(ValueError, match=r"unknown axis name\(s\) \['ep'\]"):
        make_grid(tp=2, create=["ep"])


@world.case
def test_positional_sizes_subset_dim_names_and_groups_alias():
    # DESIGN.md spells make_grid(tp, cp, pp, dp, *, groups=...); a 2-axis grid needs no cp.
    grid = make_grid(2, 1, 1, 4, dim_names=("tp", "dp"), groups=[("tp", "dp")])
    layout = GridLayout.from_grid(grid)
    assert layout == GridLayout((2, 4), ("tp", "dp"))
    assert _members(grid.get_pg(["tp", "dp"])) == list(range(8))
    default = make_grid(tp=4, dp=2, dim_names=("tp", "dp"))  # creates tp and dp only
    assert _members(default.get_pg("tp")) == layout_group(default, "tp")
    with pytest.raises(MISSING_PG_ERRORS):  # KeyError on megatron-core 0.16, ValueError on 0.19
        default.get_pg("cp")


def layout_group(grid, dims):
    return sorted(GridLayout.from_grid(grid).group_of(dist.get_rank(), dims))


@world.case
def test_destroy_grid_frees_its_groups_and_allows_rebuilding():
    from torch.distributed import distributed_c10d as c10d

    before = len(c10d._world.pg_map)
    for _ in range(5):
        grid = make_grid(tp=2, cp=2, dp=2, create=("tp", "cp", ("dp", "cp")))
        destroy_grid(grid)
        destroy_grid(grid)  # idempotent
    assert len(c10d._world.pg_map) == before
    with pytest.raises(KeyError):
        grid.get_pg("tp")
    with pytest.raises(TypeError, match="not a megatron HyperCommGrid"):
        destroy_grid(object())
