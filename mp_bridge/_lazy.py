"""Lazy re-exports: ``package.Name`` imports the submodule that defines it on first use."""

from __future__ import annotations

import importlib
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]):
    """Return a module ``__getattr__`` resolving ``exports[name]`` (a submodule) lazily."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        return value

    return __getattr__
