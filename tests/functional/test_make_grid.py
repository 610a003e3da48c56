"""make_grid in an 8-rank (and a 4-rank) world: groups hold exactly the ranks written out
by hand for each layout; errors name the argument, the value and the fix.

Device: none of these cases builds a tensor (group membership and errors only), so they
do not depend on ``current_device()`` and run unchanged in the one-GPU mode."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.grid.megatron_compat import MISSING_PG_ERRORS
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(8)


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _written_group(groups: list[list[int]], rank: int) -> list[int]:
    """The hand-written group holding ``rank`` (each rank is in exactly one)."""
    (group,) = [g for g in groups if rank in g]
    return group


# make_grid arguments -> {axes: every group of those axes, written out by hand}.
# Default order tp, cp, pp, dp (tp fastest): rank = t + tp·(c + cp·d).
LITERAL_GRIDS = {
    "tp2_cp2_dp2": (
        dict(tp=2, cp=2, dp=2),
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            ("dp", "cp"): [[0, 2, 4, 6], [1, 3, 5, 7]],
        },
    ),
    "tp2_cp4": (
        dict(tp=2, cp=4, dp=1),
        {"cp": [[0, 2, 4, 6], [1, 3, 5, 7]], "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]},
    ),
    "tp2_cp1_dp4": (
        dict(tp=2, cp=1, dp=4),
        {"cp": [[r] for r in range(8)], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    ),
    # dp fastest: rank = d + 4·t.
    "dp_first_tp2_dp4": (
        dict(tp=2, dp=4, axis_names=("dp", "tp", "cp", "pp")),
        {"tp": [[0, 4], [1, 5], [2, 6], [3, 7]], "dp": [[0, 1, 2, 3], [4, 5, 6, 7]]},
    ),
    "tp4_dp2_two_axes": (
        dict(tp=4, dp=2, axis_names=("tp", "dp")),
        {"tp": [[0, 1, 2, 3], [4, 5, 6, 7]], "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    ),
}


@world.parametrize("kwargs, groups", list(LITERAL_GRIDS.values()), ids=list(LITERAL_GRIDS))
def test_groups_hold_the_written_ranks(kwargs, groups):
    grid = make_grid(**kwargs, create=list(groups))
    rank = dist.get_rank()
    for axes, written in groups.items():
        got = _members(grid.get_pg(list(axes) if isinstance(axes, tuple) else axes))
        assert got == _written_group(written, rank), (axes, got)


@world.case
def test_default_order_is_tp_cp_pp_dp():
    layout = GridLayout.from_grid(make_grid(tp=2, cp=2, dp=2, create=()))
    assert layout.axis_names == ("tp", "cp", "pp", "dp")


@world.case
def test_offset_grid_on_part_of_the_world():
    # Every rank of the world takes part in group creation, even those outside the grid.
    grid = make_grid(tp=2, dp=2, rank_offset=4, create=["tp"])
    if dist.get_rank() >= 4:
        assert _members(grid.get_pg("tp")) == _written_group([[4, 5], [6, 7]], dist.get_rank())


@world.case
def test_world_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs 16 ranks .* world has only 8"):
        make_grid(tp=2, dp=8)
    with pytest.raises(ValueError, match=r"omits \['cp'\], whose sizes are not 1"):
        make_grid(tp=2, cp=2, axis_names=("tp", "dp"))
    with pytest.raises(ValueError, match=r"unknown axes \['ep'\]"):
        make_grid(tp=2, axis_names=("tp", "ep"))
    with pytest.raises(ValueError, match="not both"):
        make_grid(tp=2, create=["tp"], groups=["tp"])
    with pytest.raises(ValueError, match=r"unknown axis name\(s\) \['ep'\]"):
        make_grid(tp=2, create=["ep"])


@world.case
def test_positional_sizes_subset_dim_names_and_groups_alias():
    # make_grid(tp, cp, pp, dp, *, groups=...) as documented; a 2-axis grid needs no cp.
    grid = make_grid(2, 1, 1, 4, axis_names=("tp", "dp"), groups=[("tp", "dp")])
    layout = GridLayout.from_grid(grid)
    assert layout == GridLayout((2, 4), ("tp", "dp"))
    assert _members(grid.get_pg(["tp", "dp"])) == list(range(8))
    default = make_grid(tp=4, dp=2, axis_names=("tp", "dp"))  # creates tp and dp only
    assert _members(default.get_pg("tp")) == _written_group(
        [[0, 1, 2, 3], [4, 5, 6, 7]], dist.get_rank()
    )
    with pytest.raises(MISSING_PG_ERRORS):  # KeyError on megatron-core 0.16, ValueError on 0.19
        default.get_pg("cp")


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


@world.case(world_size=4)
def test_make_grid_errors_name_the_argument_and_dp_first_groups_on_four_ranks():
    with pytest.raises(ValueError, match=r"tp=0 must be an int >= 1; the make_grid tp size"):
        make_grid(tp=0)
    with pytest.raises(TypeError, match=r"dp must be an int, got 2.0; the make_grid dp size"):
        make_grid(dp=2.0)
    with pytest.raises(ValueError, match="needs 8 ranks .* world has only 4"):
        make_grid(tp=4, dp=2)
    grid = make_grid(tp=2, dp=2, axis_names=("dp", "tp"), groups=("tp",))
    # dp fastest: rank = d + 2·t, so a TP group holds ranks d and d + 2.
    want = _written_group([[0, 2], [1, 3]], dist.get_rank())
    assert _members(grid.get_pg("tp")) == want
