"""The communicator's module names in megatron-core's spelling, and the deprecated one.

megatron-core's ``MimoModel`` builds its ``ColocatedBridgeCommunicator`` with
``src_module_name=`` / ``dest_module_name=`` (megatron-core 0.18-0.19); ours takes the same
keywords in the same positions, so it can replace megatron's unchanged. ``src_name=`` /
``dest_name=`` on the communicator are deprecated spellings of the same two names.
"""

from __future__ import annotations

from mp_bridge.checks import check_str
from mp_bridge.deprecations import resolve_alias

__all__ = ["bridge_names"]


def _one(canonical: str, value: object, old: str, old_value: object, default: str) -> str:
    value = resolve_alias(
        f"mp_bridge.comm.ColocatedBridgeCommunicator({old}=...)", canonical, value, old,
        old_value, equal_ok=True,
        both=f"{old}={old_value!r} and its megatron spelling {canonical}={value!r} disagree; "
        f"pass {canonical} alone",
        # user -> __init__ -> bridge_names -> _one -> resolve_alias -> warnings.warn
        stacklevel=6,
    )  # fmt: skip
    return default if value is None else check_str(canonical, value)


def bridge_names(
    src_module_name: object,
    dest_module_name: object,
    src_name: object = None,
    dest_name: object = None,
) -> tuple[str, str]:
    """``(src, dest)`` names for messages and ``plan.describe()`` (default ``'encoder'`` /
    ``'llm'``); the deprecated ``src_name`` / ``dest_name`` warn and must agree."""
    return (
        _one("src_module_name", src_module_name, "src_name", src_name, "encoder"),
        _one("dest_module_name", dest_module_name, "dest_name", dest_name, "llm"),
    )
