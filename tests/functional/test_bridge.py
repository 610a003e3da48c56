"""ColocatedBridgeCommunicator on 8 ranks against a single-process oracle.

Every case builds the global batch X and loss weights W from one seed on every rank, so the
oracle is plain indexing of full tensors by the data contract (contiguous DP blocks in both
grids), never the plan under test.

Loss: each rank takes its dest CP chunks with ``index_select`` (chunks i and 2cp-1-i of
2cp, as in DESIGN.md) and computes ``sum(W * y)`` over them. Dest TP ranks of one replica
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
from torch.distributed import distributed_c10d as c10d

import mp_bridge.comm.bridge as bridge_module
from mp_bridge.comm import BridgeDirection, ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device

world = DistributedWorld(8)

B, S, H = 8, 8, 3  # global batch, sequence (divisible by 2*cp for cp <= 4), hidden
ORDER = ("tp", "cp", "pp", "dp")


def _cp_index(seq: int, cp: int, i: int) -> torch.Tensor:
    """Oracle CP shard: chunks i and 2cp-1-i of 2cp equal chunks, in that order."""
    c = seq // (2 * cp)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c), torch.arange((2 * cp - 1 - i) * c, (2 * cp - i) * c)]
    )


def _rows(layout: GridLayout, rank: int) -> slice:
    """Data contract: the global batch is split over DP in contiguous blocks by DP index."""
    per = B // layout.dim("dp")
    dp = layout.coords(rank)["dp"]
    return slice(dp * per, (dp + 1) * per)


def _global_tensors(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, S, H, generator=gen)
    w = torch.randn(B, S, H, generator=gen)  # differs per sample, position and channel
    return x.to(device), w.to(device)


def _grids(src, dest, *, src_order=ORDER, dest_order=ORDER, dest_groups=("cp",)):
    src_grid = make_grid(**src, dim_names=src_order, create=())
    dest_grid = make_grid(**dest, dim_names=dest_order, create=dest_groups)
    return src_grid, dest_grid


def _run(bridge, src_grid, dest_grid, *, flat=False, noncontig=False):
    """One forward+backward through bridge + CP index_select + weighted sum.

    Returns (src grad, expected grad, expected grad had the CP all-reduce been skipped,
    forward counter, backward counter).
    """
    device = current_device()
    rank = dist.get_rank()
    src, dest = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    cp, cd = dest.dim("cp"), dest.coords(rank).get("cp", 0)
    X, W = _global_tensors(device)
    xs = X[_rows(src, rank)]
    if flat:
        xs = xs.reshape(-1, H)  # batch-major flattening (b*s, h)
    if noncontig:
        # Storage has the last two dims swapped: the input view is not contiguous.
        leaf = xs.transpose(-1, -2).contiguous().requires_grad_()
        x = leaf.transpose(-1, -2)
        assert not x.is_contiguous()
    else:
        leaf = xs.clone().requires_grad_()
        x = leaf

    with CollectiveCounter() as fwd:
        y = bridge.communicate(x)
    yd = X[_rows(dest, rank)]
    y3 = y.reshape(-1, S, H) if flat else y
    assert y3.shape == yd.shape, (tuple(y.shape), tuple(yd.shape))
    assert torch.equal(y3, yd), "forward output is not this rank's dest shard"

    idx = _cp_index(S, cp, cd).to(device)
    loss = (y3.index_select(1, idx) * W[_rows(dest, rank)].index_select(1, idx)).sum()
    with CollectiveCounter() as bwd:
        loss.backward()
    grad = leaf.grad.transpose(-1, -2) if noncontig else leaf.grad
    grad = grad.reshape(-1, S, H)
    expected = W[_rows(src, rank)]
    mask = torch.zeros(S, device=device)
    mask[idx] = 1.0
    without_cp_reduce = expected * mask[None, :, None]
    return grad, expected, without_cp_reduce, fwd, bwd


def _check_case(src, dest, direction, scale, *, flat=False, noncontig=False, **grid_kw):
    src_grid, dest_grid = _grids(src, dest, **grid_kw)
    mapping = {"b": 0, "h": 1} if flat else None
    with ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping=mapping) as bridge:
        assert bridge.direction is direction and bridge.scale == scale
        grad, expected, without, fwd, bwd = _run(
            bridge, src_grid, dest_grid, flat=flat, noncontig=noncontig
        )
    assert torch.equal(grad, expected), "src gradient differs from the oracle dL/dX = W"
    cp = dest.get("cp", 1)
    if cp > 1:
        # The oracle is sensitive to the CP all-reduce: without it the gradient would be
        # W zeroed outside this rank's CP chunks, which is a different tensor.
        assert not torch.equal(without, expected)

    # Collective budget (DESIGN.md) and bytes received, exactly.
    m = (B // GridLayout.from_grid(src_grid).dim("dp")) * S * H * 4  # src shard bytes
    m_dest = (B // GridLayout.from_grid(dest_grid).dim("dp")) * S * H * 4
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
CASES = [
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


def _register(name, src, dest, direction, scale, options):
    def case():
        _check_case(src, dest, direction, scale, **options)

    case.__name__ = case.__qualname__ = f"test_{name}"
    globals()[case.__name__] = world.case(case)


for _row in CASES:
    _register(*_row)


@world.case
def test_grids_on_part_of_the_world():
    # Grids on ranks 4-7: every rank builds the communicator (group creation is global),
    # ranks inside bridge exactly, ranks outside are told they are outside.
    src_grid = make_grid(tp=1, dp=4, rank_offset=4, create=())
    dest_grid = make_grid(tp=1, cp=2, dp=2, rank_offset=4, create=("cp",))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        assert bridge.direction is BridgeDirection.FAN_IN and bridge.scale == 2
        if dist.get_rank() >= 4:
            grad, expected, _, fwd, bwd = _run(bridge, src_grid, dest_grid)
            assert torch.equal(grad, expected)
            assert fwd.counts() == {"all_gather": 1} and bwd.counts() == {"all_reduce": 1}
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
            grad, expected, without, _, bwd = _run(bridge, src_grid, dest_grid)
    finally:
        bridge_module._cp_all_reduce = original
    assert "all_reduce" not in bwd.counts()
    assert torch.equal(grad, without)
    assert not torch.equal(grad, expected)


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
        ColocatedBridgeCommunicator(src_grid, dest_grid, src_name="src", dest_name="dest")
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
def test_destroy_is_idempotent_and_frees_groups():
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    before = _live_groups()
    bridge = ColocatedBridgeCommunicator(src_grid, dest_grid)
    assert _live_groups() == before + 1  # one gather group per rank (CP: the grid's)
    bridge.destroy()
    bridge.destroy()
    assert _live_groups() == before
    assert bridge.gather_group is None and bridge.cp_group is None
    with pytest.raises(RuntimeError, match="after destroy"):
        bridge.communicate(torch.zeros(2, S, H, device=current_device()))


@world.case
def test_fifty_build_destroy_cycles_do_not_leak():
    device = current_device()
    src_grid, dest_grid = _grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    before = _live_groups()
    for i in range(50):
        with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
            if i % 10 == 0:  # the rebuilt groups work
                y = bridge.communicate(torch.full((1, 2, 1), float(dist.get_rank()), device=device))
                assert y.flatten()[::2].tolist() == list(
                    bridge.plan.gather_group_of(dist.get_rank())
                )
        assert _live_groups() == before
