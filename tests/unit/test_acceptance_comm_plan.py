"""Acceptance probes, written from the issues' and DESIGN.md's spelling of the API only.

Most tests here once failed (or pins a contract the rest of the suite left open):
EQUAL plans left ranks outside every gather group, ``plan_bridge`` refused the
``HyperCommGrid`` users hold, ``GridLayout`` refused NumPy integers, and ``mp-bridge plan``
errors did not say which flag held the bad spec.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.cli import main
from mp_bridge.comm import BridgeDirection, plan_bridge
from mp_bridge.grid import GridLayout


def _factorizations(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12])
def test_every_rank_in_exactly_one_gather_group_of_scale_members_equal_included(world):
    seen = set()
    for tps, dps in _factorizations(world, 2):
        for tpd, cpd, dpd in _factorizations(world, 3):
            src = GridLayout((tps, dps), ("tp", "dp"))
            dest = GridLayout((tpd, cpd, dpd), ("tp", "cp", "dp"))
            try:
                plan = plan_bridge(src, dest)
            except ValueError:
                continue  # DP sizes that do not divide: covered by test_bridge_plan.py
            seen.add(plan.direction)
            members = sorted(r for g in plan.gather_groups for r in g)
            assert members == list(range(world)), (src, dest, plan.gather_groups)
            assert all(len(g) == plan.scale for g in plan.gather_groups)
            for r in range(world):
                assert r in plan.gather_group_of(r)
    assert BridgeDirection.EQUAL in seen


def test_plan_bridge_reads_hyper_comm_grids(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # HyperCommGrid checks its size against it
    src = HyperCommGrid([2, 4], ["tp", "dp"])
    dest = HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    plan = plan_bridge(src, dest)
    assert plan == plan_bridge(GridLayout.from_grid(src), GridLayout.from_grid(dest))
    assert plan.gather_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    with pytest.raises(TypeError, match="dest must be a GridLayout or a HyperCommGrid"):
        plan_bridge(src, "tp=2,cp=2,dp=2")


def test_grid_layout_takes_numpy_integers():
    layout = GridLayout(np.array([2, 3]), ["tp", "dp"], np.int64(2))
    assert layout == GridLayout((2, 3), ("tp", "dp"), 2)
    assert type(layout.shape[0]) is int and type(layout.rank_offset) is int
    assert layout.coords(np.int64(5)) == {"tp": 1, "dp": 1}
    assert layout.rank(tp=np.int64(1), dp=np.int32(1)) == 5 and np.int64(7) in layout
    with pytest.raises(TypeError, match="shape entries must be ints"):
        GridLayout((2.0, 3), ("tp", "dp"))
    with pytest.raises(TypeError, match="rank must be an int"):
        layout.coords(True)


@pytest.mark.parametrize(
    ("world", "encoder", "llm", "direction"),
    [
        (1, "tp=1,dp=1", "tp=1,cp=1,dp=1", "EQUAL"),
        (2, "dp=2", "cp=2", "FAN_IN"),
        (4, "tp=2,dp=2", "tp=1,cp=2,dp=2", "EQUAL"),
        (6, "tp=1,dp=6", "tp=3,dp=2", "FAN_IN"),
        (12, "tp=6,dp=2", "tp=1,cp=2,dp=6", "FAN_OUT"),
        (16, "tp=2,dp=8", "tp=2,cp=4,dp=2", "FAN_IN"),
    ],
)
def test_cli_plan_worlds(capsys, world, encoder, llm, direction):
    assert main(["plan", "--world", str(world), "--encoder", encoder, "--llm", llm]) == 0
    out = capsys.readouterr().out
    assert f"direction {direction}" in out
    rows = [line.split()[0] for line in out.splitlines() if line[:1].isdigit()]
    assert rows == [str(r) for r in range(world)]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--world", "16"], r"--encoder: .*covers 8 ranks but the world has 16"),
        (["--world", "8", "--llm", "tp=2,cp=2,dp=3"], r"--llm: .*covers 12 ranks"),
        (["--world", "8", "--encoder", "tp=2,xp=4"], r"--encoder: .*unknown axis 'xp'"),
        (["--world", "8", "--llm", "tp=2,dp=4,"], r"--llm: .*not NAME=SIZE"),
        (["--world", "6", "--encoder", "tp=2,dp=3", "--llm", "tp=3,dp=2"], "do not divide"),
        (["--world", "0"], r"--world 0 must be >= 1"),
    ],
)
def test_cli_plan_bad_specs_one_line_naming_the_flag(capsys, argv, match):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mp-bridge plan: error:")
    assert re.search(match, err), err
