"""How a :class:`~mp_bridge.testing.DistributedWorld` reaches ranks started by forkserver
or spawn: as a reference ``(module, n)``, the n-th world built at that module's top level.

The rank imports the module (its import builds the world and registers its cases again)
and takes the world from :data:`MODULE_WORLDS`. A world built inside a function has no
such reference and refuses to be pickled, with the fix in the message.
"""

from __future__ import annotations

import importlib
from types import FrameType
from typing import Any

__all__ = ["MODULE_WORLDS", "find_world", "module_reference"]

#: Worlds built at a module's top level, by (module name, order of construction there).
MODULE_WORLDS: dict[tuple[str, int], Any] = {}


def module_reference(world: Any, caller: FrameType) -> tuple[str, int] | None:
    """Register ``world`` if ``caller`` (the frame that built it) is a module's top level;
    its reference, else ``None``."""
    if caller.f_code.co_name != "<module>":
        return None
    module = caller.f_globals.get("__name__", "")
    ref = (module, sum(1 for m, _ in MODULE_WORLDS if m == module))
    MODULE_WORLDS[ref] = world
    return ref


def find_world(module: str, index: int) -> Any:
    """The ``index``-th top-level world of ``module`` (imported here if it is not yet)."""
    importlib.import_module(module)
    try:
        return MODULE_WORLDS[(module, index)]
    except KeyError:
        raise LookupError(
            f"{module} built no top-level DistributedWorld number {index} on import; build "
            "worlds at module level so ranks started by forkserver/spawn can find them"
        ) from None
