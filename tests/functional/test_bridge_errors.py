"""ColocatedBridgeCommunicator: bad arguments and input, lifecycle, and the API as spelled.

Errors must come before any group is created or any collective runs (counted with
``CollectiveCounter`` / torch's group registry); ``destroy`` frees exactly the groups the
bridge created. Expected gather groups are written out by hand for the layout used.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from mp_bridge.comm import BridgeDirection, ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import SBH, rand

world = DistributedWorld(8)
S, H = 8, 3
ORDER = ("tp", "cp", "pp", "dp")


def _grids(src, dest, *, src_order=ORDER, dest_groups=("cp",)):
    src_grid = make_grid(**src, axis_names=src_order, create=())
    dest_grid = make_grid(**dest, create=dest_groups)
    return src_grid, dest_grid


# ------------------------------------------------------------------ errors
def _live_groups() -> int:
    # torch's registry of process groups this rank is a member of (incl. WORLD).
    return len(c10d._world.pg_map)


@world.case
def test_non_nesting_orders_rejected_before_any_group():
    src_grid, dest_grid = _grids(
        dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), src_order=("dp", "tp", "cp", "pp")
    )
    before = _live_groups()
    with pytest.raises(ValueError, match=r"do not nest: rank 2 has src coords .*dest coords"):
        ColocatedBridgeCommunicator(
            src_grid, dest_grid, src_module_name="src", dest_module_name="dest"
        )
    assert _live_groups() == before


@world.case
def test_bad_arguments_rejected_before_any_group():
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    before = _live_groups()
    with pytest.raises(ValueError, match=r"dim_mapping=\{'b': 0, 'x': 1\} must have keys"):
        ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping={"b": 0, "x": 1})
    with pytest.raises(ValueError, match="distinct tensor dims"):
        ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping={"b": 0, "h": 2})
    with pytest.raises(TypeError, match="HyperCommGrid"):
        ColocatedBridgeCommunicator(object(), dest_grid)
    small = make_grid(tp=2, dp=2, create=())
    with pytest.raises(ValueError, match="same ranks"):
        ColocatedBridgeCommunicator(small, dest_grid)
    assert _live_groups() == before


@world.case
def test_bad_input_rejected_before_any_collective():
    device = current_device()
    src_grid, dest_grid = _grids(dict(tp=8, dp=1), dict(tp=1, cp=2, dp=4))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge, CollectiveCounter() as c:
        with pytest.raises(ValueError, match=r"batch size 6 .* divisible by 4"):
            bridge.communicate(torch.zeros(6, S, H, device=device))
        with pytest.raises(ValueError, match=r"\(2 dims\) but dim_mapping"):
            bridge.communicate(torch.zeros(8, H, device=device))
        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            bridge.communicate([1.0])
    assert c.counts() == {}


# --------------------------------------------------------------- lifecycle
@world.case
def test_grid_without_cp_group_gets_it_created_on_the_grid():
    # The grid owns the CP group: the bridge asks it to create one, and destroy() leaves it.
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), dest_groups=())
    bridge = ColocatedBridgeCommunicator(src_grid, dest_grid)
    # dest tp=2, cp=2, dp=2 in (tp, cp, dp) order: CP pairs differ by 2 in rank id
    written = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3], 4: [4, 6], 5: [5, 7], 6: [4, 6]}
    written[7] = [5, 7]
    got = dist.get_process_group_ranks(dest_grid.get_pg("cp"))
    assert got == written[dist.get_rank()], got
    assert bridge.cp_group is dest_grid.get_pg("cp")
    bridge.destroy()
    assert dist.get_process_group_ranks(dest_grid.get_pg("cp")) == got  # still the grid's
    destroy_grid(dest_grid)


@world.case
def test_destroy_is_idempotent_and_frees_groups():
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    before = _live_groups()
    bridge = ColocatedBridgeCommunicator(src_grid, dest_grid)
    # One gather group per rank; CP is the grid's; the route group (the LLM DP replica,
    # tp x cp) is made only when asked for, once.
    assert _live_groups() == before + 1
    bridge.prepare_route()
    bridge.prepare_route()
    assert _live_groups() == before + 2
    bridge.destroy()
    bridge.destroy()
    assert _live_groups() == before
    assert bridge.gather_group is None and bridge.cp_group is None
    with pytest.raises(RuntimeError, match="after destroy"):
        bridge.communicate(torch.zeros(2, S, H, device=current_device()))


# tp=2,dp=4 -> tp=2,cp=2,dp=2 (rank = t + 2·d and t + 2·(c + 2·d')): dest DP replica d'
# gathers src DP blocks 2d', 2d'+1, held by the two CP ranks of the same TP rank.
GATHER_GROUP_OF = {
    0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3], 4: [4, 6], 6: [4, 6], 5: [5, 7], 7: [5, 7],
}  # fmt: skip


@world.case
def test_fifty_build_destroy_cycles_do_not_leak_and_gather_the_written_group():
    device = current_device()
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    before = _live_groups()
    for i in range(50):
        with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
            if i % 10 == 0:  # the rebuilt groups work
                y = bridge.communicate(torch.full((1, 2, 1), float(dist.get_rank()), device=device))
                assert y.flatten()[::2].tolist() == GATHER_GROUP_OF[dist.get_rank()]
        assert _live_groups() == before


@world.case(world_size=4)
def test_bridge_api_as_spelled_in_issue_3():
    src, dest = make_grid(tp=2, dp=2, create=()), make_grid(tp=1, cp=2, dp=2, create=())
    bridge = ColocatedBridgeCommunicator(
        src, dest, dim_mapping=None, src_module_name="vision", dest_module_name="lm"
    )
    assert bridge.direction is BridgeDirection.EQUAL and bridge.scale == 1
    assert bridge.plan.gather_group_of(dist.get_rank()) == (dist.get_rank(),)
    assert "vision" in bridge.plan.describe() and "lm" in bridge.plan.describe()
    x = rand(3, 4, 2, seed=3)
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match="dim_mapping"):
            bridge.communicate(x[0])  # 2-D input with the 3-D default mapping
        assert torch.equal(bridge.communicate(x), x)
    assert counter.counts() == {}  # EQUAL forward: identity
    bridge.destroy()
    bridge.destroy()  # idempotent
    with pytest.raises(RuntimeError, match="after destroy"):
        bridge.communicate(x)


@world.case(world_size=6)
def test_bridge_without_autograd_and_batch_dim_errors():
    device = current_device()
    src_grid = make_grid(tp=6, dp=1, create=())
    dest_grid = make_grid(tp=1, cp=2, dp=3, create=())
    x = rand(3, 4, 2, seed=3).transpose(0, 1)  # [s, b, h] view, batch 3 on dim 1
    with ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping=SBH) as bridge:
        assert bridge.direction is BridgeDirection.FAN_OUT and bridge.scale == 3
        slot = GridLayout.from_grid(dest_grid).coords(dist.get_rank())["dp"]
        with torch.no_grad():
            y = bridge.communicate(x)
        assert not y.requires_grad and torch.equal(y, x[:, slot : slot + 1])
        assert torch.equal(bridge.communicate(x), y)  # input without requires_grad
        with CollectiveCounter() as counter:
            with pytest.raises(ValueError, match=r"batch size 4 \(dim 1 of shape .* by 3"):
                bridge.communicate(torch.zeros(4, 4, 2, device=device))
        assert counter.counts() == {}
