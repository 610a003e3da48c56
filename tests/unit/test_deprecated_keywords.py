"""One resolver for a deprecated keyword (``mp_bridge.deprecations.resolve_alias``): the
grid's ``dim_names=`` and the communicator's ``src_name=`` / ``dest_name=`` warn at the
user's line and reject a conflicting pair with the same rule (no process group)."""

from __future__ import annotations

import pytest

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.deprecations import resolve_alias
from mp_bridge.grid import GridLayout

ROW = "mp_bridge.grid.GridLayout(dim_names=...)"


def test_resolve_alias_returns_the_value_given():
    assert resolve_alias(ROW, "axis_names", ("tp",), "dim_names", None) == ("tp",)
    with pytest.warns(DeprecationWarning, match=r"dim_names=...\) is deprecated"):
        assert resolve_alias(ROW, "axis_names", None, "dim_names", ("dp",)) == ("dp",)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"not both"):
        resolve_alias(ROW, "axis_names", ("tp",), "dim_names", ("tp",))
    with pytest.warns(DeprecationWarning):  # equal_ok: the same value twice is one value
        assert resolve_alias(ROW, "a", "x", "b", "x", equal_ok=True) == "x"


def test_each_alias_warns_at_the_users_line():
    with pytest.warns(DeprecationWarning) as grid:
        GridLayout((2,), dim_names=("tp",))
    assert grid[0].filename == __file__
    layout = GridLayout((1, 1), ("tp", "dp"))
    with pytest.warns(DeprecationWarning) as bridge, pytest.raises(RuntimeError):
        ColocatedBridgeCommunicator(layout, layout, src_name="vit")  # no world: after names
    assert bridge[0].filename == __file__
