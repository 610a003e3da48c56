"""megatron_compat: the one place that absorbs megatron-core 0.16 -> 0.19 differences.

Fake grids raise each version's error type / have or lack ``destroy()``; the real installed
``HyperCommGrid`` is checked against the version table (0.16.1 in the main venv, 0.19.2 in
``make test-megatron-latest``), so both ends of the range run these tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.grid import destroy_grid
from mp_bridge.grid.megatron_compat import (
    get_pg_or_none,
    grid_destroy,
    megatron_core_version,
    mimo_model_module,
)
from mp_bridge.models.colocated.mimo_groups import grid_group


class _Grid016:
    """Raises like megatron-core 0.16-0.18 for an axis it does not have."""

    _pgs: dict = {}

    def get_pg(self, dims):
        if dims == "tp":
            return "tp-group"
        raise KeyError(f"Process group for {dims} hasn't been created. Call create_pg first.")


class _Grid019(_Grid016):
    """Raises like megatron-core 0.19 for an axis it does not have; has destroy()."""

    def __init__(self):
        self._pgs = {}
        self.destroyed = 0

    def get_pg(self, dims):
        if dims == "tp":
            return "tp-group"
        raise ValueError(f"{dims!r} is not in view 'base' with dim_names ['tp']")

    def destroy(self):
        self.destroyed += 1


class _BrokenGrid:
    def get_pg(self, dims):
        raise RuntimeError("network down")


@pytest.mark.parametrize("grid_cls", [_Grid016, _Grid019])
def test_get_pg_or_none_absorbs_each_versions_error(grid_cls):
    grid = grid_cls()
    assert get_pg_or_none(grid, "tp") == "tp-group"
    assert get_pg_or_none(grid, "cp") is None
    assert get_pg_or_none(grid, ["dp", "cp"]) is None


def test_get_pg_or_none_lets_other_errors_through():
    with pytest.raises(RuntimeError, match="network down"):
        get_pg_or_none(_BrokenGrid(), "tp")


@pytest.mark.parametrize("grid_cls", [_Grid016, _Grid019])
def test_build_hint_survives_each_versions_error(grid_cls):
    # models.groups.grid_group turns a missing group into a ValueError with the make_grid fix.
    grid = grid_cls()
    grid.dim_names, grid.shape = ["tp", "cp"], [2, 2]
    with pytest.raises(ValueError, match=r"has no 'cp' process group; create it with make_grid"):
        grid_group(grid, ["cp"])


def test_grid_destroy_only_when_the_grid_has_one():
    assert grid_destroy(_Grid016()) is None
    grid = _Grid019()
    grid_destroy(grid)()
    assert grid.destroyed == 1


def test_destroy_grid_calls_the_grids_own_destroy():
    grid = _Grid019()  # empty _pgs: no barrier, so no process group is needed
    destroy_grid(grid)
    destroy_grid(grid)
    assert grid.destroyed == 2
    with pytest.raises(TypeError, match="not a megatron HyperCommGrid"):
        destroy_grid(object())


def test_installed_hypercommgrid_matches_the_version_table(monkeypatch):
    # The table in megatron_compat, checked on whichever version is installed.
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 4], ["tp", "dp"])
    major, minor = megatron_core_version()
    assert (major, minor) >= (0, 16) and (major, minor) < (0, 20)
    absent_axis_error = ValueError if (major, minor) >= (0, 19) else KeyError
    with pytest.raises(absent_axis_error):
        grid.get_pg("cp")  # the axis does not exist
    with pytest.raises(ValueError):
        grid.get_pg(["dp", "cp"])
    with pytest.raises(KeyError):
        grid.get_pg("tp")  # the axis exists, its group was never created
    for dims in ("cp", ["dp", "cp"], "tp"):
        assert get_pg_or_none(grid, dims) is None
    assert (grid_destroy(grid) is not None) == ((major, minor) >= (0, 17))


def test_mimo_model_module_names_the_needed_version():
    major, minor = megatron_core_version()
    if (major, minor) >= (0, 18):
        assert mimo_model_module().ColocatedBridgeCommunicator is not None
    else:
        with pytest.raises(RuntimeError, match=r"needs megatron-core >= 0.18"):
            mimo_model_module()


def test_communicator_accepts_megatron_keywords_and_rejects_conflicts():
    # Name normalization is checked before any group or world is needed (the world check
    # comes after it), so a conflict is reported even without torch.distributed.
    with (
        pytest.warns(DeprecationWarning, match=r"src_name=...\) is deprecated"),
        pytest.raises(ValueError, match=r"src_name='a' and its megatron spelling"),
    ):
        ColocatedBridgeCommunicator(None, None, src_module_name="b", src_name="a")
    with pytest.raises(TypeError, match=r"dest_module_name must be a str, got int"):
        ColocatedBridgeCommunicator(None, None, dest_module_name=3)


def test_importing_the_integration_does_not_import_megatrons_mimo_stack():
    code = (
        "import sys, mp_bridge.integrations.megatron\n"
        "print(sorted(m for m in sys.modules if m.startswith('megatron.core.models.mimo')))"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, check=True, timeout=300)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout
