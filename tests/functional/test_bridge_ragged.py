"""communicate_ragged on 8 ranks against the single-process oracle in ``_ragged_oracle``.

Covers FAN_IN k = 2, 4, 8, FAN_OUT k = 2, 4, 8 and EQUAL, dest CP 1 and 2, 2-D ``[T, h]``
and 3-D ``[T, a, h]`` tokens, custom dim orders, double backward, a member passing a
different number of samples (raises on every rank of its gather group) and local
validation (raises before any collective). Counts: 16 samples with text-only samples and
an all-zero block (samples 4-7), so some ranks hold no tokens at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ragged_oracle import H, check_double_backward, check_ragged, grids

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.testing import CollectiveCounter, DistributedWorld

world = DistributedWorld(8)

C = [3, 0, 5, 1, 0, 0, 0, 0, 2, 7, 4, 4, 0, 6, 1, 3]


@world.case
def test_fan_in_k2_cp2_2d():
    check_ragged(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2), C, direction="FAN_IN", scale=2)


@world.case
def test_fan_in_k4_cp1_3d():
    check_ragged(dict(dp=8), dict(tp=4, dp=2), C, direction="FAN_IN", scale=4, rest=(2, H))


@world.case
def test_fan_in_k8_cp2_3d():
    check_ragged(dict(dp=8), dict(tp=4, cp=2), C, direction="FAN_IN", scale=8, rest=(2, H))


@world.case
def test_fan_in_k8_cp1_2d_int32_tensor_counts():
    check_ragged(dict(dp=8), dict(tp=8), C, direction="FAN_IN", scale=8, as_tensor=True)


@world.case
def test_fan_in_custom_dim_orders():
    check_ragged(
        dict(tp=2, dp=4),
        dict(tp=2, cp=2, dp=2),
        C,
        direction="FAN_IN",
        scale=2,
        src_order=("dp", "tp", "cp", "pp"),
        dest_order=("cp", "dp", "tp", "pp"),
    )


@world.case
def test_fan_out_k2_cp2_2d():
    check_ragged(dict(tp=4, dp=2), dict(cp=2, dp=4), C, direction="FAN_OUT", scale=2)


@world.case
def test_fan_out_k4_cp2_3d():
    check_ragged(dict(tp=8), dict(cp=2, dp=4), C, direction="FAN_OUT", scale=4, rest=(2, H))


@world.case
def test_fan_out_k4_cp1_3d():
    check_ragged(dict(tp=4, dp=2), dict(dp=8), C, direction="FAN_OUT", scale=4, rest=(2, H))


@world.case
def test_fan_out_k8_cp1_2d():
    check_ragged(dict(tp=8), dict(dp=8), C, direction="FAN_OUT", scale=8)


@world.case
def test_equal_cp2_3d():
    check_ragged(dict(tp=2, dp=4), dict(cp=2, dp=4), C, direction="EQUAL", scale=1, rest=(2, H))


@world.case
def test_equal_cp1_2d():
    check_ragged(dict(tp=2, dp=4), dict(tp=2, dp=4), C, direction="EQUAL", scale=1)


@world.case
def test_double_backward_fan_in():
    check_double_backward(dict(tp=2, dp=4), dict(tp=4, dp=2), C)


@world.case
def test_double_backward_fan_out():
    check_double_backward(dict(tp=4, dp=2), dict(dp=8), C)


@world.case
def test_member_with_other_sample_count_raises_on_its_whole_group():
    # FAN_IN k=2, gather groups (0,2), (1,3), (4,6), (5,7): ranks 2 and 6 pass 3 samples.
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=4, dp=2))
    rank = dist.get_rank()
    counts = [1, 2, 0] if rank in (2, 6) else [1, 2]
    x = torch.randn(sum(counts), H)
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        if rank in (0, 2, 4, 6):
            with pytest.raises(ValueError, match=r"passed different numbers of samples"):
                bridge.communicate_ragged(x, counts)
        else:
            y, dest_counts = bridge.communicate_ragged(x, counts)
            assert dest_counts.tolist() == [1, 2, 1, 2] and y.shape == (6, H)
        # A row-shape mismatch is caught by the same header.
        x = torch.randn(3, H + (rank == 3))
        if rank in (1, 3):
            with pytest.raises(ValueError, match=r"tokens of different row sizes"):
                bridge.communicate_ragged(x, [1, 2])
        else:
            assert bridge.communicate_ragged(x, [1, 2])[0].shape == (6, H)
        dist.barrier()  # nobody is left inside a collective


@world.case
def test_validation_raises_before_any_collective():
    src_grid, dest_grid = grids(dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2))
    x = torch.randn(5, H)
    cases = [
        ([2, -1, 4], r"tokens_per_sample=\[2, -1, 4\] has negative counts \[-1\]"),
        ([2, 2], r"sums to 4 but x has 5 tokens"),
        (torch.tensor([2.0, 3.0]), r"dtype torch.float32; pass an integer tensor"),
        (torch.tensor([[2, 3]]), r"shape \(1, 2\) \(2 dims\); pass a 1-D tensor"),
    ]
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        with CollectiveCounter() as counter:
            for counts, match in cases:
                with pytest.raises(ValueError, match=match):
                    bridge.communicate_ragged(x, counts)
            with pytest.raises(TypeError, match=r"sequence of ints, got int"):
                bridge.communicate_ragged(x, 5)
            with pytest.raises(ValueError, match=r"pass the flat tokens \[T, \*rest\]"):
                bridge.communicate_ragged(torch.tensor(1.0), [1])
        assert counter.calls == []
    with pytest.raises(RuntimeError, match=r"after destroy\(\)"):
        bridge.communicate_ragged(x, [5])
