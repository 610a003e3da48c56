"""GridLayout: literal rank lists, round trips, errors, and exact agreement with megatron."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.grid import GridLayout


@pytest.fixture(autouse=True)
def _world_size_env(monkeypatch):
    # HyperCommGrid reads WORLD_SIZE when no process group exists; make it large enough.
    monkeypatch.setenv("WORLD_SIZE", "4096")


def test_literal_groups_tp_cp_dp_2x2x2():
    g = GridLayout((2, 2, 2), ("tp", "cp", "dp"))
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups(["dp", "cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.groups(["tp", "cp", "dp"]) == [list(range(8))]


def test_literal_groups_dp_first_with_offset():
    g = GridLayout((4, 2), ("dp", "tp"), rank_offset=8)
    assert g.groups("dp") == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.groups("tp") == [[8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.coords(13) == {"dp": 1, "tp": 1}
    assert g.rank(dp=3, tp=0) == 11


def test_size_dim_and_repr():
    g = GridLayout((2, 3, 1, 4), ("tp", "cp", "pp", "dp"))
    assert g.size == 24
    assert (
        g.axis_size("tp"),
        g.axis_size("cp"),
        g.axis_size("pp"),
        g.axis_size("dp"),
        g.axis_size("ep"),
    ) == (2, 3, 1, 4, 1)
    assert repr(g) == "GridLayout(tp=2, cp=3, pp=1, dp=4)"
    assert 23 in g and 24 not in g


def test_coords_rank_round_trip_every_rank():
    g = GridLayout((3, 2, 2), ("cp", "tp", "dp"), rank_offset=5)
    seen = set()
    for r in g.ranks:
        c = g.coords(r)
        assert g.rank(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == g.size


def test_rank_accepts_absent_axis_at_zero_and_omitted_unit_axis():
    g = GridLayout((2, 1, 2), ("tp", "pp", "dp"))
    assert g.rank(tp=1, dp=1, cp=0) == 3


def test_from_grid_matches_hypercommgrid():
    hcg = HyperCommGrid([2, 2, 1, 2], ["tp", "cp", "pp", "dp"], rank_offset=0)
    g = GridLayout.from_grid(hcg)
    assert g == GridLayout((2, 2, 1, 2), ("tp", "cp", "pp", "dp"))


@st.composite
def layouts_and_dims(draw):
    names_pool = ["tp", "cp", "pp", "dp", "ep"]
    n = draw(st.integers(1, 5))
    names = draw(st.permutations(names_pool))[:n]
    shape = [draw(st.integers(1, 4)) for _ in names]
    offset = draw(st.integers(0, 16))
    k = draw(st.integers(1, n))
    dims = draw(st.permutations(names))[:k]
    return shape, names, offset, dims


@settings(max_examples=300, deadline=None)
@given(layouts_and_dims())
def test_groups_equal_megatron_rank_enum(case):
    shape, names, offset, dims = case
    hcg = HyperCommGrid(list(shape), list(names), rank_offset=offset)
    ours = GridLayout(tuple(shape), tuple(names), offset)
    assert ours.groups(list(dims)) == hcg.get_rank_enum(list(dims))
    if len(dims) == 1:  # megatron also accepts a bare string
        assert ours.groups(dims[0]) == hcg.get_rank_enum(dims[0])


@settings(max_examples=200, deadline=None)
@given(layouts_and_dims())
def test_groups_partition_the_grid_and_match_coords(case):
    shape, names, offset, dims = case
    g = GridLayout(tuple(shape), tuple(names), offset)
    groups = g.groups(list(dims))
    flat = list(itertools.chain.from_iterable(groups))
    assert sorted(flat) == list(g.ranks)
    assert all(len(grp) == math.prod(g.axis_size(d) for d in dims) for grp in groups)
    others = [n for n in names if n not in dims]
    for grp in groups:  # members agree on every other axis
        assert len({tuple(g.coords(r)[n] for n in others) for r in grp}) == 1
        assert g.group_of(grp[-1], list(dims)) == grp


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(shape=(2, 2), axis_names=("tp", "tp")), ValueError, r"repeats \['tp'\]"),
        (dict(shape=(2, 0), axis_names=("tp", "dp")), ValueError, r"non-positive sizes \[0\]"),
        (dict(shape=(2, -1), axis_names=("tp", "dp")), ValueError, "non-positive"),
        (dict(shape=(2,), axis_names=("tp", "dp")), ValueError, "one size per name"),
        (dict(shape=(2.0,), axis_names=("tp",)), TypeError, "must be ints"),
        (dict(shape=(2,), axis_names=("",)), TypeError, "non-empty strings"),
        (dict(shape=(2,), axis_names=("tp",), rank_offset=-1), ValueError, "negative"),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        GridLayout(**kwargs)


def test_unknown_dim_lists_valid_names():
    g = GridLayout((2, 2), ("tp", "dp"))
    with pytest.raises(ValueError, match=r"unknown axis name\(s\) \['cp'\].*\['tp', 'dp'\]"):
        g.groups("cp")
    with pytest.raises(ValueError, match="repeats an axis"):
        g.groups(["tp", "tp"])
    with pytest.raises(ValueError, match="dims is empty"):
        g.groups([])


def test_rank_and_coord_errors():
    g = GridLayout((2, 2), ("tp", "dp"), rank_offset=4)
    with pytest.raises(ValueError, match=r"rank=3 is outside .* \[4, 8\)"):
        g.coords(3)
    with pytest.raises(ValueError, match=r"rank=8 is outside"):
        g.coords(8)
    with pytest.raises(ValueError, match=r"coordinate tp=2 is out of range .* 0 <= tp < 2"):
        g.rank(tp=2, dp=0)
    with pytest.raises(ValueError, match=r"coordinate cp=1 is out of range"):
        g.rank(tp=0, dp=0, cp=1)
    with pytest.raises(ValueError, match=r"missing \['dp'\]"):
        g.rank(tp=1)
    with pytest.raises(TypeError, match="rank must be an int"):
        g.coords("4")


def test_from_grid_rejects_other_objects():
    with pytest.raises(TypeError, match="expects a HyperCommGrid"):
        GridLayout.from_grid(object())


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
