"""The registry of fused-loss engines: each name and the module that holds it.

An engine module is imported here, on first use, and nowhere else: importing
``mp_bridge`` or running the ``"torch"`` engine never imports ``triton``. Each module
exports ``ENGINE``, an object of the ``FusedLossEngine`` protocol (``protocol``). No
``mp_bridge`` import here (the options parser resolves ``engine`` through this module,
and the protocol names the options: a leaf keeps the import graph acyclic).
"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch

__all__ = ["ENGINES", "ENGINE_MODULES", "engine_module", "resolve_engine"]

#: The choices of ``engine=`` on the fused doors: ``"auto"`` is ``"triton"`` for CUDA
#: tensors (when it imports), else ``"torch"``.
ENGINES = ("auto", "torch", "triton")

#: Engine name -> its module (which exports ``ENGINE``) and what installing it takes.
ENGINE_MODULES: dict[str, tuple[str, str]] = {
    "torch": ("mp_bridge.layers.loss.engines.torch", "it ships with mp_bridge"),
    "triton": ("mp_bridge.layers.loss.engines.triton", "pip install triton"),
}


def engine_module(name: str) -> ModuleType:
    """The module of engine ``name`` (imported on first use, then cached by Python).

    ``ImportError`` naming the engine and how to install it when the module or a package
    it needs (``triton``) does not import.
    """
    module, install = ENGINE_MODULES[name]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"engine={name!r} is unavailable here ({exc}): {install} (the GPU engine's "
            "kernels; its tests run on CPU under TRITON_INTERPRET=1), or pass "
            "engine='torch'"
        ) from exc


def resolve_engine(engine: str, device: torch.device) -> str:
    """The engine that runs for the validated choice ``engine`` (``ENGINES``) on tensors of
    ``device``: ``"torch"`` or ``"triton"``; imports its module.

    An explicit choice that does not import raises ``ImportError`` (``engine_module``).
    ``"auto"`` on CUDA tensors whose ``"triton"`` engine does not import falls back to
    ``"torch"`` with a warning (once per process under the default filter), so a
    CUDA machine without ``triton`` keeps today's engine.
    """
    if engine != "auto":
        engine_module(engine)
        return engine
    if device.type != "cuda":
        return "torch"
    try:
        engine_module("triton")
    except ImportError as exc:
        # Issued from this one line, so the default filter shows it once per process.
        warnings.warn(f"engine='auto' runs the 'torch' engine on CUDA tensors: {exc}", stacklevel=1)
        return "torch"
    return "triton"
