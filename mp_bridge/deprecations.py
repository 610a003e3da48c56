"""Deprecated public names: one table (old -> new -> removal release) and one warning.

Floor 0 (imports nothing from ``mp_bridge``): every package may use it. A renamed public
name keeps working for one release: the old spelling calls :func:`warn_deprecated` with
its row's key, which emits a ``DeprecationWarning`` naming the replacement and the release
that removes it. A package's module-level alias uses :func:`alias_getattr`::

    __getattr__ = alias_getattr(__name__, {"old_name": "new_name"}, globals())
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEPRECATIONS", "Deprecation", "alias_getattr", "resolve_alias", "warn_deprecated"]


@dataclass(frozen=True)
class Deprecation:
    """``old`` (a dotted public name) is spelled ``new`` now; ``old`` goes in ``removal``."""

    old: str
    new: str
    removal: str


#: Every deprecated public name, keyed by its old dotted name.
DEPRECATIONS: dict[str, Deprecation] = {
    d.old: d
    for d in (
        Deprecation("mp_bridge.grid.GridLayout.dim_names", "GridLayout.axis_names", "0.3.0"),
        Deprecation("mp_bridge.grid.GridLayout.dim", "GridLayout.axis_size", "0.3.0"),
        Deprecation(
            "mp_bridge.grid.GridLayout(dim_names=...)", "GridLayout(axis_names=...)", "0.3.0"
        ),
        Deprecation(
            "mp_bridge.grid.make_grid(dim_names=...)", "make_grid(axis_names=...)", "0.3.0"
        ),
        Deprecation("mp_bridge.comm.cp_factor", "seq_len_divisor(cp)", "0.3.0"),
        Deprecation(
            "mp_bridge.comm.RouteCache",
            "mp_bridge.comm.PlanCache (it caches balance plans as well as routes)",
            "0.3.0",
        ),
        Deprecation(
            "mp_bridge.comm.ColocatedBridgeCommunicator(src_name=...)",
            "ColocatedBridgeCommunicator(src_module_name=...) (megatron-core's keyword)",
            "0.3.0",
        ),
        Deprecation(
            "mp_bridge.comm.ColocatedBridgeCommunicator(dest_name=...)",
            "ColocatedBridgeCommunicator(dest_module_name=...) (megatron-core's keyword)",
            "0.3.0",
        ),
        Deprecation("mp_bridge.checks.check_group_arg", "mp_bridge.checks.check_group", "0.3.0"),
        Deprecation(
            "mp_bridge.models.ColocatedMimoModel(encoder, projection, llm, bridge, partition)",
            "ColocatedMimoModel(encoder, projection, llm, make_mimo_groups(encoder_grid, "
            "llm_grid), image_token_id=...)",
            "0.3.0",
        ),
        Deprecation(
            "mp_bridge.models.MimoGroups(bridge=<an object that is not a Bridge>)",
            "a mp_bridge.comm.Bridge: LocalBridge() for one process, "
            "ColocatedBridgeCommunicator on grids",
            "0.3.0",
        ),
        Deprecation(
            "mp_bridge.models.run_parity(encoder_dim_names=...)",
            "run_parity(encoder_axis_names=...)",
            "0.3.0",
        ),
        Deprecation(
            "mp_bridge.models.run_parity(llm_dim_names=...)",
            "run_parity(llm_axis_names=...)",
            "0.3.0",
        ),
    )
}


def warn_deprecated(old: str, *, stacklevel: int = 3) -> None:
    """Emit the ``DeprecationWarning`` of row ``old`` (``KeyError`` if it has no row).

    ``stacklevel=3`` points at the caller of the function that calls this one.
    """
    row = DEPRECATIONS[old]
    warnings.warn(
        f"{row.old} is deprecated and will be removed in mp_bridge {row.removal}; use {row.new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def resolve_alias(
    row: str,
    new: str,
    value: Any,
    old: str,
    old_value: Any,
    *,
    both: str | None = None,
    equal_ok: bool = False,
    stacklevel: int = 4,
) -> Any:
    """The value of keyword ``new``, or of ``old``, its deprecated spelling: the one place
    a deprecated keyword alias is resolved.

    ``old_value is None``: ``value`` as given. Else warns with row ``row`` of
    :data:`DEPRECATIONS` (``stacklevel=4``: the caller of the function that calls this
    one) and returns ``old_value``; when ``value`` is given too, ``ValueError`` (``both``,
    or "pass new= or its deprecated alias old=, not both"), unless ``equal_ok`` and the two
    are equal. E.g. ``resolve_alias(row, "axis_names", None, "dim_names", ("tp",))`` warns
    and returns ``("tp",)``.
    """
    if old_value is None:
        return value
    warn_deprecated(row, stacklevel=stacklevel)
    if value is not None and not (equal_ok and value == old_value):
        raise ValueError(both or f"pass either {new}= or its deprecated alias {old}=, not both")
    return old_value


def alias_getattr(
    module: str, aliases: Mapping[str, str], namespace: Mapping[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``aliases`` (old attribute -> new attribute).

    Each old name must have a row ``f"{module}.{old}"`` in :data:`DEPRECATIONS`.
    """
    missing = [f"{module}.{old}" for old in aliases if f"{module}.{old}" not in DEPRECATIONS]
    if missing:
        raise KeyError(f"add rows for {missing} to mp_bridge.deprecations.DEPRECATIONS")

    def __getattr__(name: str) -> Any:
        if name in aliases:
            warn_deprecated(f"{module}.{name}")
            return namespace[aliases[name]]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
