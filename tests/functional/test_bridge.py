"""ColocatedBridgeCommunicator against the single-process data-contract oracle.

Worlds of 8 ranks (one parametrized case per layout, with its collective budget), 6 ranks
(DP ratio k = 3, CP = 3 and 6, low precision) and 4 ranks (GridLayouts, odd axis orders).
Every rank builds the global batch X and loss weights W from one seed, so the oracle
(``tests.oracles.run_bridge``) is plain indexing of full tensors by the data contract
(contiguous DP blocks in both grids), never the plan under test.

Loss: each rank takes its dest CP chunks with ``index_select`` (chunks i and 2cp-1-i of
2cp: ``cp_shard_indices``) and computes ``sum(W * y)`` over them. Dest TP ranks of one replica
hold the same data and, as after the LLM's TP ``copy_to_group`` backward, each receives
the gradient of the whole loss; so the oracle loss counts every dest (sample, position)
once: ``L = sum(W * X)`` over the global batch, and ``dL/dX = W``. Every rank's src shard
gradient must therefore equal W restricted to its src rows, over the full sequence.

Tolerance: none (``torch.equal``). The forward only copies, and the backward sums, for
each element, one nonzero partial with zeros (the other CP ranks' zero-padding), so the
results are bitwise exact on any backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mp_bridge.comm.bridge.execution.dense as bridge_module
from mp_bridge.comm import BridgeDirection, ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import DistributedWorld, current_device
from tests.oracles import FLAT, SBH, bridge_mismatches, run_bridge

world = DistributedWorld(8)

B, S, H = 8, 8, 3  # global batch, sequence (divisible by 2*cp for cp <= 4), hidden
ORDER = ("tp", "cp", "pp", "dp")


def _grids(src, dest, *, src_order=ORDER, dest_order=ORDER, dest_groups=("cp",)):
    src_grid = make_grid(**src, axis_names=src_order, create=())
    dest_grid = make_grid(**dest, axis_names=dest_order, create=dest_groups)
    return src_grid, dest_grid


def _run(bridge, src_grid, dest_grid, *, flat=False, noncontig=False):
    src, dest = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    mapping = FLAT if flat else None
    return run_bridge(bridge, src, dest, batch=B, seq=S, mapping=mapping, strided=noncontig)


def _check_case(src, dest, direction, scale, *, flat=False, noncontig=False, **grid_kw):
    src_grid, dest_grid = _grids(src, dest, **grid_kw)
    mapping = FLAT if flat else None
    with ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping=mapping) as bridge:
        assert bridge.direction is direction and bridge.scale == scale
        run = _run(bridge, src_grid, dest_grid, flat=flat, noncontig=noncontig)
    assert not run.problems, run.problems
    cp = dest.get("cp", 1)
    if cp > 1:
        # The oracle is sensitive to the CP all-reduce: without it the gradient would be
        # W zeroed outside this rank's CP chunks, which is a different tensor.
        assert not torch.equal(run.grad_without_cp_reduce, run.expected_grad)
    fwd, bwd = run.forward, run.backward
    # Collective budget (the communicator's docstring) and bytes received, exactly.
    m = (B // GridLayout.from_grid(src_grid).axis_size("dp")) * S * H * 4  # src shard bytes
    m_dest = (B // GridLayout.from_grid(dest_grid).axis_size("dp")) * S * H * 4
    want_fwd = {"all_gather": 1} if direction is BridgeDirection.FAN_IN else {}
    want_bwd = {"all_gather": 1} if direction is BridgeDirection.FAN_OUT else {}
    if cp > 1:
        want_bwd["all_reduce"] = 1
    assert fwd.counts() == want_fwd, fwd.calls
    assert bwd.counts() == want_bwd, bwd.calls
    if direction is BridgeDirection.FAN_IN:
        assert fwd.calls[0].group_size == scale
        assert fwd.bytes_received("all_gather") == (scale - 1) * m  # lower bound (k-1)·m
    if direction is BridgeDirection.FAN_OUT:
        assert [c.group_size for c in bwd.calls if c.name == "all_gather"] == [scale]
        assert bwd.bytes_received("all_gather") == (scale - 1) * m // scale  # (k-1)·m/k
    if cp > 1:
        assert [c.group_size for c in bwd.calls if c.name == "all_reduce"] == [cp]
        assert bwd.bytes_received("all_reduce") == m_dest


# One case per row: (name, encoder layout, LLM layout, direction, scale, options).
FAN_IN, FAN_OUT, EQUAL = BridgeDirection.FAN_IN, BridgeDirection.FAN_OUT, BridgeDirection.EQUAL
SRC_DP_FASTEST, DEST_CP_DP_FASTEST = ("dp", "tp", "cp", "pp"), ("cp", "dp", "tp", "pp")
CASES = [  # one parametrized case per row, its id the name
    ("fan_in_cp2_grid_cp_group", dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), FAN_IN, 2, {}),
    (
        "fan_in_cp4_flat_grid_cp_group",
        dict(tp=1, dp=8),
        dict(tp=2, cp=4, dp=1),
        FAN_IN,
        8,
        dict(flat=True),
    ),
    (
        "fan_in_cp1_noncontiguous",
        dict(tp=2, dp=4),
        dict(tp=4, dp=2),
        FAN_IN,
        2,
        dict(noncontig=True),
    ),
    ("fan_in_k4_dest_tp_larger", dict(tp=1, dp=8), dict(tp=4, dp=2), FAN_IN, 4, {}),
    ("fan_in_k4_cp2", dict(tp=2, dp=4), dict(tp=4, cp=2, dp=1), FAN_IN, 4, {}),
    # src dp fastest (rank = ds + 4·ts), dest cp fastest then dp: dd = ds // 2 on every rank.
    (
        "fan_in_dp_fastest_orders_that_nest",
        dict(tp=2, dp=4),
        dict(tp=2, cp=2, dp=2),
        FAN_IN,
        2,
        dict(src_order=SRC_DP_FASTEST, dest_order=DEST_CP_DP_FASTEST),
    ),
    (
        "fan_out_cp2_noncontiguous_grid_cp_group",
        dict(tp=4, dp=2),
        dict(tp=1, cp=2, dp=4),
        FAN_OUT,
        2,
        dict(noncontig=True),
    ),
    ("fan_out_cp4_flat", dict(tp=8, dp=1), dict(tp=1, cp=4, dp=2), FAN_OUT, 2, dict(flat=True)),
    ("fan_out_k4_cp2", dict(tp=8, dp=1), dict(tp=1, cp=2, dp=4), FAN_OUT, 4, {}),
    ("fan_out_cp1_scale8", dict(tp=8, dp=1), dict(tp=1, dp=8), FAN_OUT, 8, {}),
    ("equal_cp1_is_identity", dict(tp=2, dp=4), dict(tp=2, dp=4), EQUAL, 1, {}),
    ("equal_cp2", dict(tp=2, dp=4), dict(tp=1, cp=2, dp=4), EQUAL, 1, {}),
    (
        "equal_cp4_flat_noncontiguous",
        dict(tp=4, dp=2),
        dict(tp=1, cp=4, dp=2),
        EQUAL,
        1,
        dict(flat=True, noncontig=True),
    ),
]
IDS_8 = [row[0] for row in CASES]
CASES_8 = [row[1:] for row in CASES]


@world.parametrize("src, dest, direction, scale, options", CASES_8, ids=IDS_8)
def test_bridge_layout_of_eight_ranks(src, dest, direction, scale, options):
    _check_case(src, dest, direction, scale, **options)


@world.case
def test_grids_on_part_of_the_world():
    # Grids on ranks 4-7: every rank builds the communicator (group creation is global),
    # ranks inside bridge exactly, ranks outside are told they are outside.
    src_grid = make_grid(tp=1, dp=4, rank_offset=4, create=())
    dest_grid = make_grid(tp=1, cp=2, dp=2, rank_offset=4, create=("cp",))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        assert bridge.direction is BridgeDirection.FAN_IN and bridge.scale == 2
        if dist.get_rank() >= 4:
            run = _run(bridge, src_grid, dest_grid)
            assert not run.problems, run.problems
            assert run.forward.counts() == {"all_gather": 1}
            assert run.backward.counts() == {"all_reduce": 1}
        else:
            with pytest.raises(ValueError, match=r"rank \d is outside the bridged grids"):
                bridge.communicate(torch.zeros(2, S, H, device=current_device()))


# ------------------------------------------------- the CP all-reduce matters
@world.case
def test_skipping_cp_all_reduce_is_caught():
    # Negative control: with the CP all-reduce replaced by the identity the gradient is
    # W zeroed outside this rank's CP chunks, and the oracle comparison rejects it.
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    original = bridge_module._cp_all_reduce
    bridge_module._cp_all_reduce = lambda grad, group: grad
    try:
        with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
            run = _run(bridge, src_grid, dest_grid)
    finally:
        bridge_module._cp_all_reduce = original
    assert "all_reduce" not in run.backward.counts()
    assert torch.equal(run.grad, run.grad_without_cp_reduce)
    assert len(run.problems) == 1 and "src gradient is not W" in run.problems[0], run.problems


# ------------------------------------------------------------------ 6 ranks
@world.case(world_size=6)
def test_bridge_layouts_of_six_ranks():
    bad = []
    # EQUAL, dest CP 2, dest TP < src TP.
    bad += bridge_mismatches(dict(tp=2, dp=3), dict(tp=1, cp=2, dp=3), batch=3, seq=8)
    # FAN_IN k=3, dest TP > src TP, bf16, one sample per src rank.
    bad += bridge_mismatches(
        dict(tp=1, dp=6), dict(tp=2, dp=3), batch=6, seq=4, dtype=torch.bfloat16
    )
    # FAN_IN k=3 into CP 6, [s, b, h] input (batch on dim 1).
    bad += bridge_mismatches(dict(tp=2, dp=3), dict(tp=1, cp=6, dp=1), batch=3, seq=12, mapping=SBH)
    # FAN_OUT k=3 with dest CP 2, fp16.
    bad += bridge_mismatches(
        dict(tp=6, dp=1), dict(tp=1, cp=2, dp=3), batch=3, seq=4, dtype=torch.float16
    )
    # FAN_OUT k=3, src local batch == k, flattened (b*s, h).
    bad += bridge_mismatches(dict(tp=3, dp=2), dict(tp=1, dp=6), batch=6, seq=4, mapping=FLAT)
    # dp fastest in both grids (rank = dp + 3·tp and rank = dp + 3·cp) still nests.
    bad += bridge_mismatches(
        dict(tp=2, dp=3),
        dict(tp=1, cp=2, dp=3),
        batch=3,
        seq=4,
        src_order=("dp", "tp", "cp", "pp"),
        dest_order=("dp", "cp", "tp", "pp"),
    )
    assert not bad, bad


@world.case(world_size=6)
def test_bridge_grids_on_part_of_six_ranks():
    bad = []
    # Ranks 2-5: FAN_IN k=2; ranks 1-4: FAN_OUT k=2 with dest CP 2 ([s, b, h] input).
    bad += bridge_mismatches(dict(tp=1, dp=4), dict(tp=2, dp=2), batch=4, seq=4, offset=2)
    bad += bridge_mismatches(
        dict(tp=4, dp=1), dict(tp=1, cp=2, dp=2), batch=2, seq=4, offset=1, mapping=SBH
    )
    assert not bad, bad


# ------------------------------------------------------------------ 4 ranks
@world.case(world_size=4)
def test_bridge_layouts_of_four_ranks():
    bad = []
    bad += bridge_mismatches(dict(tp=1, dp=4), dict(tp=1, cp=4, dp=1), batch=4, seq=8)  # FAN_IN k=4
    bad += bridge_mismatches(
        dict(tp=4, dp=1), dict(tp=1, cp=1, dp=4), batch=8, seq=4
    )  # FAN_OUT k=4
    bad += bridge_mismatches(dict(tp=2, dp=2), dict(tp=1, cp=2, dp=2), batch=2, seq=4, strided=True)
    bad += bridge_mismatches(dict(tp=1, dp=4), dict(tp=2, dp=2), batch=4, seq=4, mapping=FLAT)
    bad += bridge_mismatches(
        dict(tp=2, dp=2),
        dict(tp=1, cp=4, dp=1),
        batch=2,
        seq=8,
        src_order=("dp", "tp", "cp", "pp"),
        dest_order=("cp", "tp", "pp", "dp"),
    )
    assert not bad, bad


@world.case(world_size=4)
def test_bridge_on_grid_layouts_creates_its_cp_groups():
    # GridLayouts hold no groups: the communicator creates the dest CP groups (it called
    # dest_grid.get_pg and crashed with AttributeError before).
    bad = bridge_mismatches(dict(tp=2, dp=2), dict(tp=1, cp=2, dp=2), batch=2, seq=4, layouts=True)
    bad += bridge_mismatches(dict(tp=1, dp=4), dict(tp=1, cp=2, dp=2), batch=4, seq=4, layouts=True)
    assert not bad, bad
