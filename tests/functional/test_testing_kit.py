"""DistributedWorld: many cases in one world, per-case reports, no long hang on a stuck case,
cases at several world sizes and parametrized cases in one module.

Most tests here check small worlds of their own (the thing under test is the world itself);
the module-level ``world`` shows the registration forms as pytest collects them.

Device: none. The cases test the world itself (start-up, per-case reports, aborts of a
stuck case); their one-element all-reduces stay on the CPU, which gloo carries in every
mode, so they do not depend on ``current_device()``.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from mp_bridge.testing import DistributedError, DistributedWorld

world = DistributedWorld(2, timeout_s=120)


@world.case
def test_default_size_case_runs_on_two_ranks():
    assert dist.get_world_size() == 2


@world.case(world_size=3)
def test_sized_case_runs_on_three_ranks():
    x = torch.ones(1)
    dist.all_reduce(x)
    assert dist.get_world_size() == 3 and x.item() == 3


@world.parametrize("n, name", [(1, "one"), (3, "three")])
def test_parametrized_case_gets_its_values(n, name):
    assert {1: "one", 3: "three"}[n] == name


@world.parametrize("size", [1, 2, 3], world_size=3)
def test_parametrized_sized_case(size):
    group = dist.new_group(list(range(size)))  # collective over the 3-rank world
    if dist.get_rank() < size:
        assert dist.get_world_size(group) == size


# The worlds below are the things under test. They are built at module level, like every
# world of the suite, so their ranks can start by forkserver/spawn as well as by fork (the
# kit's contract, ``mp_bridge.testing``); their cases are named ``case_*`` so pytest runs
# them only through the tests that check them.
shared = DistributedWorld(4, timeout_s=60)
_PIDS: list[int] = []


@shared.case
def case_ok():
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == 4
    return dist.get_rank()


@shared.case
def case_fails_on_rank_3_after_its_collectives():
    x = torch.ones(1)
    dist.all_reduce(x)
    assert dist.get_rank() != 3, "rank 3 disagrees"


@shared.case
def case_still_runs_after_a_symmetric_failure():
    _PIDS.append(os.getpid())
    x = torch.ones(1)
    dist.all_reduce(x)
    return os.getpid()


def test_cases_share_one_world_and_report_separately():
    assert shared.check("case_ok") == [0, 1, 2, 3]
    with pytest.raises(DistributedError, match=r"failed on rank 3:(.|\n)*rank 3 disagrees"):
        case_fails_on_rank_3_after_its_collectives()
    later = shared.check("case_still_runs_after_a_symmetric_failure")
    assert len(set(later)) == 4  # four processes, one world started once
    assert _PIDS == []  # the cases ran in the children, not here


stuck = DistributedWorld(3, timeout_s=120, abort_grace_s=2)


@stuck.case
def case_before():
    dist.barrier()


def _rank_0_raises_before_a_collective() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("bad input on rank 0")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here for rank 0 forever


@stuck.case
def case_rank_0_raises_before_a_collective():
    _rank_0_raises_before_a_collective()


@stuck.case
def case_after():
    x = torch.ones(1)
    dist.all_reduce(x)  # would pair with the stuck all-reduce in the same world
    return x.item()


def test_case_stuck_in_a_collective_stops_the_world_quickly():
    start = time.monotonic()
    case_before()  # finished before the failure: still reported as passing
    elapsed = time.monotonic() - start
    assert elapsed < 60, f"the world waited {elapsed:.0f} s; it should stop ~2 s after the failure"
    with pytest.raises(DistributedError, match=r"failed on rank 0:(.|\n)*bad input on rank 0"):
        case_rank_0_raises_before_a_collective()
    assert stuck.check("case_after") == [3.0, 3.0, 3.0]  # a new world ran the rest


sized = DistributedWorld(4, timeout_s=120)


@sized.case
def case_default():
    return dist.get_world_size(), os.getpid()


@sized.case(world_size=2)
def case_two():
    return dist.get_world_size(), os.getpid()


@sized.case(world_size=2)
def case_two_again():
    return dist.get_world_size(), os.getpid()


@sized.case(world_size=3)
def case_expects_six_ranks_but_registered_at_three():
    assert dist.get_world_size() == 6, f"world size {dist.get_world_size()}, not 6"


def test_cases_at_several_sizes_each_see_their_own_world():
    assert sized.sizes == (4, 2, 3)
    default, two, two_again = (
        sized.check(n) for n in ("case_default", "case_two", "case_two_again")
    )
    assert [s for s, _ in default] == [4] * 4 and [s for s, _ in two] == [2, 2]
    assert two == two_again  # one start-up per size: the same two processes ran both cases
    assert not {p for _, p in two} & {p for _, p in default}  # and another world for size 4
    with pytest.raises(DistributedError, match=r"failed on rank 0:(.|\n)*world size 3, not 6"):
        case_expects_six_ranks_but_registered_at_three()


params = DistributedWorld(2, timeout_s=120)


@params.parametrize("cp, sp", [(1, False), (2, True)], world_size=3)
def case_shard(cp, sp):
    assert not sp or dist.get_rank() != 2, "rank 2 rejects sp"
    return cp * 10 + dist.get_world_size()


@params.parametrize("layout", [dict(tp=2), dict(tp=4)], ids=["tp2", "tp4"])
def case_layout(layout):
    return layout["tp"]


def test_parametrize_registers_one_case_and_one_test_id_per_set():
    (mark,) = case_shard.pytestmark
    assert mark.name == "parametrize" and mark.args == ("world_case", ["1-False", "2-True"])
    assert case_shard.__name__ == "case_shard"
    assert params.check("case_shard[1-False]") == [13, 13, 13]
    case_layout("tp4")
    assert params.check("case_layout[tp2]") == [2, 2]
    with pytest.raises(DistributedError, match=r"case_shard\[2-True\]' failed on rank 2"):
        case_shard("2-True")


sizes_apart = DistributedWorld(2, timeout_s=120, abort_grace_s=2)


@sizes_apart.case(world_size=3)
def case_three_ranks_rank_0_raises_before_a_collective():
    _rank_0_raises_before_a_collective()


@sizes_apart.case
def case_two_ranks_still_run():
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def test_a_stuck_world_of_one_size_leaves_the_other_sizes_alone():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"failed on rank 0:(.|\n)*bad input on rank 0"):
        case_three_ranks_rank_0_raises_before_a_collective()
    assert time.monotonic() - start < 60  # stopped ~2 s after the failure, not at 120 s
    assert sizes_apart.check("case_two_ranks_still_run") == [2.0, 2.0]


sleepy = DistributedWorld(2, timeout_s=120, abort_grace_s=2)


@sleepy.case
def case_rank_1_sleeps():
    if dist.get_rank() == 1:
        time.sleep(600)  # rank 0 ends the case and waits for it
    return dist.get_rank()


def test_a_rank_hanging_outside_a_collective_in_a_case_is_named():
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        case_rank_1_sleeps()
    assert time.monotonic() - start < 60  # stopped ~2 s after rank 0 ended the case
    text = str(info.value)
    assert info.value.rank == 1 and "did not finish on rank 1" in text
    assert re.search(
        r"rank 1 is at \S*test_testing_kit.py:\d+ in case_rank_1_sleeps \(outside", text
    )
    assert "rank 0 is at" in text and "(finished, waiting for the other ranks)" in text


def test_duplicate_case_names_are_rejected():
    world = DistributedWorld(2)

    def test_same():
        pass

    world.case(test_same)
    with pytest.raises(ValueError, match="registered twice"):
        world.case(test_same)


def test_registration_errors_name_the_problem():
    world = DistributedWorld(2)
    with pytest.raises(ValueError, match=r"world_size=0 must be an int >= 1; the number of ranks"):
        world.case(world_size=0)(lambda: None)
    with pytest.raises(ValueError, match=r"world_size=0 must be an int >= 1; the number of ranks"):
        DistributedWorld(0)
    with pytest.raises(TypeError, match=r"timeout_s must be a float, got '10'"):
        DistributedWorld(2, timeout_s="10")
    with pytest.raises(ValueError, match=r"abort_grace_s=nan must be a finite float > 0"):
        DistributedWorld(2, abort_grace_s=float("nan"))
    with pytest.raises(ValueError, match=r"parameter set 1 \(1,\) has 1 values"):
        world.parametrize("a, b", [(1, 2), (1,)])
    with pytest.raises(ValueError, match="ids has 1 entries for 2"):
        world.parametrize("a", [1, 2], ids=["x"])
    with pytest.raises(ValueError, match="not unique"):
        world.parametrize("a", ["x", "x"])(lambda a: None)
    with pytest.raises(KeyError, match="no case 'test_missing'"):
        world.check("test_missing")
