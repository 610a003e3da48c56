"""Every difference between the megatron-core versions we support (0.16.x - 0.19.x).

The rest of mp_bridge never branches on megatron's version: it calls these helpers.
Read from each release's source (0.16.1, 0.17.0, 0.18.0, 0.19.2); the suite runs on 0.16.1
and 0.19.2:

============================================  ==============  ================================
difference                                    0.16            0.17 - 0.19
============================================  ==============  ================================
``grid.get_pg("x")``, the grid has no axis x  ``KeyError``    ``KeyError`` (0.17, 0.18),
                                                              ``ValueError`` (0.19)
``grid.get_pg(["x", ...])``, no axis x        ``ValueError``  ``ValueError``
``grid.get_pg(axis)``, group never created    ``KeyError``    ``KeyError``
``HyperCommGrid.destroy()``                   absent          frees the grid's groups
``MimoModel``'s colocated communicator        absent          absent (0.17);
                                                              ``mimo.model.base`` (0.18, 0.19)
Requires-Python of the wheel                  ``>=3.10``      ``>=3.12``
``import megatron.core`` imports ``triton``   no              yes (0.19, even on CPU)
``ShardedTensor.from_rank_offsets``,          same            same (what the vocab layers'
``metadata["dp_cp_group"]``                                   ``sharded_state_dict`` use)
``make_tp_sharded_tensor_for_checkpoint``     TP, FSDP2       + GTP params (0.19); falls back
                                                              to ``parallel_state`` when both
                                                              groups are ``None``: not used
============================================  ==============  ================================

:func:`get_pg_or_none` catches both error types on every version (so a missing group is
never mistaken for another error, whichever version raised it), :func:`grid_destroy`
returns the grid's own ``destroy`` when it has one, and :func:`mimo_model_module` finds
the module whose ``ColocatedBridgeCommunicator`` name ``MimoModel`` constructs. No
function here imports megatron at module import time.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module, metadata
from types import ModuleType
from typing import Any

__all__ = [
    "MIMO_COMMUNICATOR_MODULE",
    "MISSING_PG_ERRORS",
    "get_pg_or_none",
    "grid_destroy",
    "megatron_core_version",
    "mimo_model_module",
]

#: What ``HyperCommGrid.get_pg`` raises for a group it does not hold, on any supported
#: version (see the module table).
MISSING_PG_ERRORS: tuple[type[Exception], ...] = (KeyError, ValueError)

#: The module of megatron-core >= 0.18 that imports ``ColocatedBridgeCommunicator`` and
#: calls it from ``MimoModel._build_colocated_communicators``.
MIMO_COMMUNICATOR_MODULE = "megatron.core.models.mimo.model.base"


def get_pg_or_none(grid: Any, dims: str | list[str]) -> Any:
    """``grid.get_pg(dims)``, or ``None`` when the grid holds no such group.

    "No such group" is an axis the grid does not have or a group ``create_pg`` never
    built; megatron-core 0.16 and 0.19 report those with different exception types
    (module table). Any other exception propagates.
    """
    try:
        return grid.get_pg(dims)
    except MISSING_PG_ERRORS:
        return None


def grid_destroy(grid: Any) -> Callable[[], None] | None:
    """The grid's own ``destroy()`` (megatron-core >= 0.17), or ``None`` when it has none."""
    destroy = getattr(type(grid), "destroy", None)
    if destroy is None or not callable(destroy):
        return None
    return grid.destroy


def megatron_core_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed megatron-core, read from its package metadata
    (imports nothing; ``PackageNotFoundError``, an ``ImportError``, when not installed)."""
    major, minor = metadata.version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def mimo_model_module() -> ModuleType:
    """The megatron module whose ``ColocatedBridgeCommunicator`` name ``MimoModel`` builds.

    Raises ``RuntimeError`` naming the installed version when it has no such module
    (megatron-core < 0.18 ships no colocated communicator in ``MimoModel``).
    """
    try:
        module = import_module(MIMO_COMMUNICATOR_MODULE)
    except ImportError as exc:
        module, error = None, exc
    else:
        error = None
    if module is None or not hasattr(module, "ColocatedBridgeCommunicator"):
        try:
            found = ".".join(map(str, megatron_core_version()))
        except ImportError:
            found = "not installed"
        raise RuntimeError(
            f"megatron-core {found} has no MimoModel colocated communicator "
            f"({MIMO_COMMUNICATOR_MODULE}.ColocatedBridgeCommunicator); the MimoModel "
            "integration needs megatron-core >= 0.18 (tested: 0.19.2); "
            "pip install 'megatron-core==0.19.2'"
        ) from error
    return module
