"""`mp-bridge plan` and layout-spec parsing (pure; no process group)."""

from __future__ import annotations

import re

import pytest

from mp_bridge.cli import main
from mp_bridge.grid import GridLayout, parse_layout_spec


def test_parse_spec_keeps_written_order_and_appends_unit_axes():
    assert parse_layout_spec("tp=2,dp=4") == GridLayout((2, 4, 1, 1), ("tp", "dp", "cp", "pp"))
    assert parse_layout_spec("dp=2, tp=4", world_size=8).axis_names[:2] == ("dp", "tp")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("", "is empty"),
        ("tp2", "is not NAME=SIZE"),
        ("xp=2", r"unknown axis 'xp'; valid axes are \['tp', 'cp', 'pp', 'dp'\]"),
        ("tp=2,tp=2", "given twice"),
        ("tp=two", "is not an integer"),
        ("tp=0", "must be >= 1"),
        ("tp=2,dp=2", "covers 4 ranks but the world has 8"),
    ],
)
def test_parse_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_layout_spec(spec, world_size=8)


def test_plan_prints_direction_scale_and_every_rank_groups(capsys):
    code = main(["plan", "--world", "8", "--encoder", "tp=2,dp=4", "--llm", "tp=2,cp=2,dp=2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "direction FAN_IN, scale 2, dest cp 2" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    by_rank = {int(r[0]): r[1:] for r in rows}
    assert sorted(by_rank) == list(range(8)) and len(rows) == 8
    # rank 5: encoder coords, llm coords, slot, gather group, cp group.
    assert by_rank[5] == ["tp=1,dp=2", "tp=1,cp=0,dp=1", "0", "[5,7]", "[5,7]"]
    assert by_rank[2] == ["tp=0,dp=1", "tp=0,cp=1,dp=0", "1", "[0,2]", "[0,2]"]


def test_plan_fan_out_splits_gather_groups_per_cp(capsys):
    assert main(["plan", "--encoder", "tp=4,dp=2", "--llm", "tp=1,cp=2,dp=4"]) == 0
    out = capsys.readouterr().out
    assert "direction FAN_OUT, scale 2" in out
    by_rank = {r[0]: r[1:] for r in (ln.split() for ln in out.splitlines() if ln[:1].isdigit())}
    assert by_rank["3"][-2:] == ["[1,3]", "[2,3]"]


def test_plan_non_nesting_prints_coords_then_one_line_error(capsys):
    code = main(["plan", "--encoder", "dp=4,tp=2", "--llm", "tp=2,cp=2,dp=2"])
    captured = capsys.readouterr()
    assert code == 2
    assert "2     dp=2,tp=0  tp=0,cp=1,dp=0" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "layouts do not nest: rank 2 has encoder coords" in err[0]


def test_plan_bad_spec_is_one_line_error(capsys):
    code = main(["plan", "--world", "8", "--encoder", "tp=3,dp=4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "covers 12 ranks but the world has 8" in err[0]


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


def test_plan_pipelined_llm_shows_stage_and_what_goes_where(capsys):
    assert main(["plan", "--encoder", "tp=2,dp=4", "--llm", "tp=2,pp=2,dp=2"]) == 0
    out = capsys.readouterr().out
    assert "llm pp 2: stage 0 consumes encoder rows" in out
    table = out[out.index("llm pp 2") :]
    by_rank = {r[0]: r[1:] for r in (ln.split() for ln in table.splitlines() if ln[:1].isdigit())}
    # rank 0 (stage 0) gets piece (1,0) from rank 2; rank 2 (stage 1) only sends.
    assert by_rank["0"] == ["0", "(0,0)", "(1,0)", "-", "2:(1,0)", "-"]
    assert by_rank["2"] == ["1", "-", "0:(1,0)", "-", "0:(1,0)"]
