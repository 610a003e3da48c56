"""communicate_ragged on 8 and 6 ranks against the single-process oracle in
``tests.functional.ragged_oracle`` (forward tokens and counts, gradient of a weighted sum,
CP all-reduce sensitivity, exact collective counts and bytes, no aliasing).

Covers FAN_IN k = 2, 3, 4, 6, 8, FAN_OUT k = 2, 3, 4, 8 and EQUAL, dest CP 1, 2 and 3, 2-D
``[T, h]`` and 3-D ``[T, a, h]`` tokens, custom dim orders, double backward, a member
passing a different number of samples (raises on every rank of its gather group) and
local validation (raises before any collective). Counts: text-only samples and an
all-zero DP block, so some ranks hold no tokens at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.functional.ragged_oracle import H, check_double_backward, check_ragged, grids

world = DistributedWorld(8)

C8 = [3, 0, 5, 1, 0, 0, 0, 0, 2, 7, 4, 4, 0, 6, 1, 3]  # 16 samples; samples 4-7 all zero
C6 = [2, 5, 0, 0, 0, 0, 1, 4, 3, 6, 0, 2]  # 12 samples; samples 3-5 all zero
TOKENS_2D, TOKENS_3D = (H,), (2, H)
ORDERS = dict(src_order=("dp", "tp", "cp", "pp"), dest_order=("cp", "dp", "tp", "pp"))

# id, src, dest, direction, scale, options
CASES_8 = [
    ("fan_in_k2_cp2_2d", dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), "FAN_IN", 2, {}),
    ("fan_in_k4_cp1_3d", dict(dp=8), dict(tp=4, dp=2), "FAN_IN", 4, dict(rest=TOKENS_3D)),
    ("fan_in_k8_cp2_3d", dict(dp=8), dict(tp=4, cp=2), "FAN_IN", 8, dict(rest=TOKENS_3D)),
    ("fan_in_k8_cp1_int32", dict(dp=8), dict(tp=8), "FAN_IN", 8, dict(as_tensor=True)),
    ("fan_in_k2_orders", dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), "FAN_IN", 2, ORDERS),
    ("fan_out_k2_cp2_2d", dict(tp=4, dp=2), dict(cp=2, dp=4), "FAN_OUT", 2, {}),
    ("fan_out_k4_cp2_3d", dict(tp=8), dict(cp=2, dp=4), "FAN_OUT", 4, dict(rest=TOKENS_3D)),
    ("fan_out_k4_cp1_3d", dict(tp=4, dp=2), dict(dp=8), "FAN_OUT", 4, dict(rest=TOKENS_3D)),
    ("fan_out_k8_cp1_2d", dict(tp=8), dict(dp=8), "FAN_OUT", 8, {}),
    ("equal_cp2_3d", dict(tp=2, dp=4), dict(cp=2, dp=4), "EQUAL", 1, dict(rest=TOKENS_3D)),
    ("equal_cp1_2d", dict(tp=2, dp=4), dict(tp=2, dp=4), "EQUAL", 1, {}),
]
CASES_6 = [
    ("fan_in_k2_cp3_2d", dict(tp=3, dp=2), dict(tp=2, cp=3), "FAN_IN", 2, {}),
    ("fan_in_k3_cp1_3d", dict(dp=6), dict(tp=3, dp=2), "FAN_IN", 3, dict(rest=TOKENS_3D)),
    ("fan_in_k6_cp3_3d", dict(dp=6), dict(tp=2, cp=3), "FAN_IN", 6, dict(rest=TOKENS_3D)),
    ("fan_out_k2_cp3_3d", dict(tp=6), dict(cp=3, dp=2), "FAN_OUT", 2, dict(rest=TOKENS_3D)),
    ("fan_out_k3_cp2_2d", dict(tp=6), dict(cp=2, dp=3), "FAN_OUT", 3, {}),
    ("fan_out_k2_cp1_2d", dict(tp=2, dp=3), dict(dp=6), "FAN_OUT", 2, {}),
    ("equal_cp3_2d", dict(tp=3, dp=2), dict(cp=3, dp=2), "EQUAL", 1, {}),
]


@world.parametrize(
    "src, dest, direction, scale, options", [c[1:] for c in CASES_8], ids=[c[0] for c in CASES_8]
)
def test_ragged_layout_of_eight_ranks(src, dest, direction, scale, options):
    check_ragged(src, dest, C8, direction=direction, scale=scale, **options)


@world.parametrize(
    "src, dest, direction, scale, options",
    [c[1:] for c in CASES_6],
    ids=[c[0] for c in CASES_6],
    world_size=6,
)
def test_ragged_layout_of_six_ranks(src, dest, direction, scale, options):
    check_ragged(src, dest, C6, direction=direction, scale=scale, **options)


@world.parametrize(
    "src, dest",
    [
        (dict(tp=2, dp=4), dict(tp=4, dp=2)),
        (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)),
        (dict(tp=4, dp=2), dict(dp=8)),
        (dict(tp=4, dp=2), dict(cp=2, dp=4)),
        (dict(tp=2, dp=4), dict(cp=2, dp=4)),
    ],
    ids=["fan_in_cp1", "fan_in_cp2", "fan_out_cp1", "fan_out_cp2", "equal_cp2"],
)
def test_double_backward(src, dest):
    check_double_backward(src, dest, C8)


@world.case
def test_member_with_other_sample_count_raises_on_its_whole_group():
    # FAN_IN k=2, gather groups (0,2), (1,3), (4,6), (5,7): ranks 2 and 6 pass 3 samples.
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=4, dp=2))
    rank = dist.get_rank()
    counts = [1, 2, 0] if rank in (2, 6) else [1, 2]
    x = torch.randn(sum(counts), H).to(current_device())
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        if rank in (0, 2, 4, 6):
            with pytest.raises(ValueError, match=r"passed different numbers of samples"):
                bridge.communicate_ragged(x, counts)
        else:
            y, dest_counts = bridge.communicate_ragged(x, counts)
            assert dest_counts.tolist() == [1, 2, 1, 2] and y.shape == (6, H)
        # A row-shape mismatch is caught by the same header.
        x = torch.randn(3, H + (rank == 3)).to(current_device())
        if rank in (1, 3):
            with pytest.raises(ValueError, match=r"tokens of different row sizes"):
                bridge.communicate_ragged(x, [1, 2])
        else:
            assert bridge.communicate_ragged(x, [1, 2])[0].shape == (6, H)
        dist.barrier()  # nobody is left inside a collective


@world.case(world_size=6)
def test_member_with_other_sample_count_raises_on_six_ranks():
    # FAN_IN k=3, gather groups (0, 1, 2) and (3, 4, 5): rank 4 passes 3 samples, not 2.
    src_grid, dest_grid = grids(dict(dp=6), dict(tp=3, dp=2))
    rank = dist.get_rank()
    counts = [4, 0, 1] if rank == 4 else [0, 3]
    x = torch.randn(sum(counts), H).to(current_device())
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        if rank >= 3:
            match = r"gather group \[3, 4, 5\] passed different numbers of samples .*rank 4: 3"
            with pytest.raises(ValueError, match=match):
                bridge.communicate_ragged(x, counts)
        else:
            y, dest_counts = bridge.communicate_ragged(x, counts)
            assert dest_counts.tolist() == [0, 3] * 3 and y.shape == (9, H)
        dist.barrier()


@world.case
def test_validation_raises_before_any_collective():
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    dev = current_device()
    x = torch.randn(5, H).to(dev)
    cases = [
        ([2, -1, 4], r"tokens_per_sample=\[2, -1, 4\] has negative counts \[-1\]"),
        ([2, 2], r"sums to 4 but x has 5 tokens"),
        (torch.tensor([2.0, 3.0], device=dev), r"dtype torch.float32; pass an integer tensor"),
        (torch.tensor([[2, 3]], device=dev), r"shape \(1, 2\) \(2 dims\); pass a 1-D tensor"),
    ]
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with CollectiveCounter() as counter:
            for counts, match in cases:
                with pytest.raises(ValueError, match=match):
                    bridge.communicate_ragged(x, counts)
            with pytest.raises(TypeError, match=r"sequence of ints, got int"):
                bridge.communicate_ragged(x, 5)
            with pytest.raises(ValueError, match=r"pass the flat tokens \[T, \*rest\]"):
                bridge.communicate_ragged(torch.tensor(1.0, device=dev), [1])
        assert counter.calls == []
    with pytest.raises(RuntimeError, match=r"after destroy\(\)"):
        bridge.communicate_ragged(x, [5])
