"""GridLayout's axis spellings (axis_names, axis_size) and their deprecated dim-named aliases."""

from __future__ import annotations

import pytest

from mp_bridge.deprecations import DEPRECATIONS
from mp_bridge.grid import AXIS_NAMES, GridLayout, make_grid


def test_axis_names_and_sizes():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert layout.axis_names == ("tp", "cp", "dp")
    assert [layout.axis_size(a) for a in ("tp", "cp", "pp", "dp")] == [2, 3, 1, 4]
    assert AXIS_NAMES == ("tp", "cp", "pp", "dp")


def test_dim_spellings_still_work_and_warn():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    with pytest.warns(DeprecationWarning, match=r"GridLayout.dim_names is deprecated.*axis_names"):
        assert layout.dim_names == ("tp", "cp", "dp")
    with pytest.warns(DeprecationWarning, match=r"GridLayout.dim is deprecated.*axis_size"):
        assert [layout.dim(a) for a in ("tp", "pp")] == [2, 1]
    with pytest.warns(DeprecationWarning, match=r"GridLayout\(dim_names=...\) is deprecated"):
        assert GridLayout((2, 4), dim_names=("tp", "dp")) == GridLayout((2, 4), ("tp", "dp"))


def test_every_alias_has_a_row_with_a_removal_release():
    for old in (
        "mp_bridge.grid.GridLayout.dim_names",
        "mp_bridge.grid.GridLayout.dim",
        "mp_bridge.grid.GridLayout(dim_names=...)",
        "mp_bridge.grid.make_grid(dim_names=...)",
    ):
        assert DEPRECATIONS[old].removal == "0.3.0"


def test_groups_names_the_argument():
    layout = GridLayout((2, 2), ("tp", "dp"))
    with pytest.raises(ValueError, match="dims is empty"):
        layout.groups([])
    with pytest.raises(ValueError, match=r"dims=\['tp', 'tp'\] repeats an axis name"):
        layout.groups(["tp", "tp"])


def test_both_spellings_are_rejected_before_anything_else():
    with pytest.raises(ValueError, match="axis_names= or its deprecated alias dim_names="):
        make_grid(dp=2, dim_names=("tp", "dp"), axis_names=("tp", "dp"))
    with pytest.raises(ValueError, match=r"axis_names= \(or its deprecated alias dim_names=\)"):
        GridLayout((2,), ("tp",), dim_names=("tp",))
