"""GridLayout's axis spellings (axis_names, axis_size) and their dim-named aliases."""

from __future__ import annotations

import pytest

from mp_bridge.grid import AXIS_NAMES, GridLayout, make_grid


def test_axis_names_and_sizes_with_aliases():
    layout = GridLayout((2, 3, 4), ("tp", "cp", "dp"))
    assert layout.axis_names == layout.dim_names == ("tp", "cp", "dp")
    assert [layout.axis_size(a) for a in ("tp", "cp", "pp", "dp")] == [2, 3, 1, 4]
    assert [layout.dim(a) for a in ("tp", "cp", "pp", "dp")] == [2, 3, 1, 4]
    assert AXIS_NAMES == ("tp", "cp", "pp", "dp")


def test_groups_names_the_argument():
    layout = GridLayout((2, 2), ("tp", "dp"))
    with pytest.raises(ValueError, match="dims is empty"):
        layout.groups([])
    with pytest.raises(ValueError, match=r"dims=\['tp', 'tp'\] repeats an axis name"):
        layout.groups(["tp", "tp"])


def test_make_grid_rejects_both_spellings_before_anything_else():
    with pytest.raises(ValueError, match="dim_names= or its alias axis_names="):
        make_grid(dp=2, dim_names=("tp", "dp"), axis_names=("tp", "dp"))
