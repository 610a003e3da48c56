"""DistributedWorld: many cases in one world, per-case reports, no long hang on a stuck case.

Each test here builds its own small world (the thing under test is the world itself).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from mp_bridge.testing import DistributedError, DistributedWorld


def test_cases_share_one_world_and_report_separately():
    world = DistributedWorld(4, timeout_s=60)
    pids: list[int] = []

    @world.case
    def test_ok():
        x = torch.ones(1)
        dist.all_reduce(x)
        assert x.item() == 4
        return dist.get_rank()

    @world.case
    def test_fails_on_rank_3_after_its_collectives():
        x = torch.ones(1)
        dist.all_reduce(x)
        assert dist.get_rank() != 3, "rank 3 disagrees"

    @world.case
    def test_still_runs_after_a_symmetric_failure():
        import os

        pids.append(os.getpid())
        x = torch.ones(1)
        dist.all_reduce(x)
        return os.getpid()

    assert world.check("test_ok") == [0, 1, 2, 3]
    with pytest.raises(DistributedError, match=r"failed on rank 3:(.|\n)*rank 3 disagrees"):
        test_fails_on_rank_3_after_its_collectives()
    later = world.check("test_still_runs_after_a_symmetric_failure")
    assert len(set(later)) == 4  # four processes, one world started once
    assert pids == []  # the cases ran in the children, not here


def test_case_stuck_in_a_collective_stops_the_world_quickly():
    world = DistributedWorld(3, timeout_s=120, abort_grace_s=2)

    @world.case
    def test_before():
        dist.barrier()

    @world.case
    def test_rank_0_raises_before_a_collective():
        if dist.get_rank() == 0:
            raise RuntimeError("bad input on rank 0")
        dist.all_reduce(torch.ones(1))  # ranks 1, 2 wait here for rank 0 forever

    @world.case
    def test_after():
        dist.barrier()

    start = time.monotonic()
    test_before()  # finished before the failure: still reported as passing
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"the world waited {elapsed:.0f} s; it should stop ~2 s after the failure"
    with pytest.raises(DistributedError, match=r"failed on rank 0:(.|\n)*bad input on rank 0"):
        test_rank_0_raises_before_a_collective()
    with pytest.raises(DistributedError, match=r"did not finish on rank 0: case .*rank 0"):
        test_after()


def test_duplicate_case_names_are_rejected():
    world = DistributedWorld(2)

    def test_same():
        pass

    world.case(test_same)
    with pytest.raises(ValueError, match="registered twice"):
        world.case(test_same)
