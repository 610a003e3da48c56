"""Both launchers name the rank (and the case) that failed first, whatever the fault.

Faults injected on one rank while its peers wait in (or head for) an all-reduce: a
raise, ``os._exit``, ``SIGKILL``, a hang and ``pytest.skip``. ``run_distributed`` must
name that rank (exit code or signal), not a peer that lost its connection to it.
``DistributedWorld`` must report each case on its own: a case that passed stays passed,
the failing case names its rank (a hang shows the hanging rank's stack), a skip skips
that case only, and the cases after a fault still run correctly (a fresh world).

Device: none. These cases test the launchers' fault reports; the one-element all-reduces
that peers wait in stay on the CPU, which gloo carries in every mode (also the one-GPU
mode), so a killed or hanging rank never holds a CUDA context.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from mp_bridge.testing import DistributedError, DistributedWorld, run_distributed

FAULTY = 1  # the rank that fails in every case below


def _fault(kind: str, peers_reduce: bool = True) -> None:
    """Inject ``kind`` on rank ``FAULTY``; the other ranks go on to an all-reduce (unless
    not ``peers_reduce``: then they end at once, so the hanging rank is the only one)."""
    if dist.get_rank() == FAULTY:
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "exit":
            os._exit(3)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "hang":
            time.sleep(600)
        if kind == "skip":
            pytest.skip("injected skip")
    if peers_reduce:
        dist.all_reduce(torch.ones(1))


# ------------------------------------------------------------------ run_distributed
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("raise", r"^rank 1 raised:(.|\n)*RuntimeError: injected fault"),
        ("exit", r"^rank 1 died \(exit code 3\) before returning"),
        ("kill", r"^rank 1 died \(killed by signal SIGKILL\) before returning"),
    ],
)
def test_run_distributed_names_the_faulty_rank(kind, expected):
    # Repeated: before, a peer's "Connection closed by peer" was named in 8 of 12 runs.
    for _ in range(3):
        with pytest.raises(DistributedError, match=expected) as info:
            run_distributed(_fault, 3, kind, timeout_s=120)
        assert info.value.rank == FAULTY


def test_run_distributed_hang_shows_the_hanging_stack():
    with pytest.raises(DistributedError, match=r"timed out after 15 s") as info:
        run_distributed(_fault, 2, "hang", timeout_s=15)
    text = str(info.value)
    assert "--- stacks of rank 1 ---" in text and "in _fault" in text  # rank 1 in sleep
    assert "--- stacks of rank 0 ---" in text  # rank 0, waiting in the all-reduce


def _skip_everywhere() -> None:
    pytest.skip("not on this backend")


def test_run_distributed_skip_skips_the_test():
    with pytest.raises(pytest.skip.Exception, match=r"rank \d skipped: not on this backend"):
        run_distributed(_skip_everywhere, 2, timeout_s=120)


def _named(kind: str):
    def case():
        # A hang while the peers wait in a collective looks like a hang on every rank
        # (each is stuck); with the peers done, the hanging rank is the one named.
        _fault(kind, peers_reduce=kind != "hang")

    case.__name__ = f"test_fault_{kind}"
    return case


# ------------------------------------------------------------------ DistributedWorld
# Built at module level, like every world of the suite, so its ranks can start by
# forkserver/spawn too (the kit's contract); its cases run only through the test below.
faults = DistributedWorld(2, timeout_s=120, abort_grace_s=5)


@faults.case
def case_before():
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


for _kind in ("raise", "exit", "kill", "hang", "skip"):
    faults.case(_named(_kind))


@faults.case
def case_after():  # a misaligned world would pair this all-reduce with a stale one
    x = torch.full((1,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    return x.item()


def test_world_reports_each_fault_in_its_own_case():
    start = time.monotonic()
    assert faults.check("case_before") == [2.0, 2.0]  # passed before any fault: stays so
    expected = {
        "raise": r"'test_fault_raise' failed on rank 1:(.|\n)*RuntimeError: injected fault",
        "exit": r"'test_fault_exit' failed on rank 1:(.|\n)*rank 1 died \(exit code 3\)",
        "kill": r"'test_fault_kill' failed on rank 1:(.|\n)*killed by signal SIGKILL",
        "hang": r"'test_fault_hang' did not finish on rank 1(.|\n)*stacks of rank 1(.|\n)*_fault",
    }
    for kind, pattern in expected.items():
        with pytest.raises(DistributedError, match=pattern) as info:
            faults.check(f"test_fault_{kind}")
        assert info.value.rank == FAULTY
    with pytest.raises(pytest.skip.Exception, match="skipped on rank 1: injected skip"):
        faults.check("test_fault_skip")
    assert faults.check("case_after") == [3.0, 3.0]  # 1 + 2: aligned, in a fresh world
    assert faults.check("case_before") == [2.0, 2.0]
    # Each fault stopped its world early (grace 5 s, plus a restart each): without that,
    # raise, exit, kill and hang would each wait out the 120 s timeout (480 s); 300 s
    # leaves room for 6 world starts on a loaded 2-core machine.
    assert time.monotonic() - start < 300
