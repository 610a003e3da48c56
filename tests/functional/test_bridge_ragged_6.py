"""communicate_ragged on 6 ranks (a second world size; dest CP = 3) against the oracle in
``_ragged_oracle``: FAN_IN k = 2, 3, 6, FAN_OUT k = 2, 3 and EQUAL, dest CP 1, 2 and 3,
2-D and 3-D tokens, and a sample-count mismatch raising on its whole gather group.
Counts: 12 samples with text-only samples and an all-zero block (samples 3-5).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _ragged_oracle import H, check_ragged, grids

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(6)

C = [2, 5, 0, 0, 0, 0, 1, 4, 3, 6, 0, 2]


@world.case
def test_fan_in_k2_cp3_2d():
    check_ragged(dict(tp=3, dp=2), dict(tp=2, cp=3), C, direction="FAN_IN", scale=2)


@world.case
def test_fan_in_k3_cp1_3d():
    check_ragged(dict(dp=6), dict(tp=3, dp=2), C, direction="FAN_IN", scale=3, rest=(2, H))


@world.case
def test_fan_in_k6_cp3_3d():
    check_ragged(dict(dp=6), dict(tp=2, cp=3), C, direction="FAN_IN", scale=6, rest=(2, H))


@world.case
def test_fan_out_k2_cp3_3d():
    check_ragged(dict(tp=6), dict(cp=3, dp=2), C, direction="FAN_OUT", scale=2, rest=(2, H))


@world.case
def test_fan_out_k3_cp2_2d():
    check_ragged(dict(tp=6), dict(cp=2, dp=3), C, direction="FAN_OUT", scale=3)


@world.case
def test_fan_out_k2_cp1_2d():
    check_ragged(dict(tp=2, dp=3), dict(dp=6), C, direction="FAN_OUT", scale=2)


@world.case
def test_equal_cp3_2d():
    check_ragged(dict(tp=3, dp=2), dict(cp=3, dp=2), C, direction="EQUAL", scale=1)


@world.case
def test_member_with_other_sample_count_raises_on_its_whole_group():
    # FAN_IN k=3, gather groups (0, 1, 2) and (3, 4, 5): rank 4 passes 3 samples, not 2.
    src_grid, dest_grid = grids(dict(dp=6), dict(tp=3, dp=2))
    rank = dist.get_rank()
    counts = [4, 0, 1] if rank == 4 else [0, 3]
    x = torch.randn(sum(counts), H)
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        if rank >= 3:
            match = r"gather group \[3, 4, 5\] passed different numbers of samples .*rank 4: 3"
            with pytest.raises(ValueError, match=match):
                bridge.communicate_ragged(x, counts)
        else:
            y, dest_counts = bridge.communicate_ragged(x, counts)
            assert dest_counts.tolist() == [0, 3] * 3 and y.shape == (9, H)
        dist.barrier()  # nobody is left inside a collective
