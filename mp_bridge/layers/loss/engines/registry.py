"""The registry of fused-loss engines: each name, the module that holds it, and what it
can run, as data (``ENGINE_CAPS``), which the ``"auto"`` choice and the check of an
explicit one read (``protocol.choose_engine``).

An engine module is imported on first use, by :func:`engine_module`, and nowhere else:
importing ``mp_bridge`` or running the ``"torch"`` engine never imports ``triton``. Each
module exports ``ENGINE``, an object of the ``FusedLossEngine`` protocol (``protocol``).
No ``mp_bridge`` import here: a leaf keeps the import graph acyclic.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = ["AUTO_ORDER", "ENGINES", "ENGINE_CAPS", "EngineCaps", "engine_module"]


@dataclass(frozen=True)
class EngineCaps:
    """The static capabilities of one engine: what it runs whatever the shapes.

    ``module``: the package that exports ``ENGINE``. ``needs``: the packages it imports
    beyond torch, and ``install``: how to get them. ``devices``: the device types of the
    tensors it runs (``None``: any); ``interpreted``: ``(variable, device type)``, a
    device type it also runs while the environment variable is ``"1"`` (an interpreter).
    ``dtypes``: the floating dtypes of ``hidden`` / ``weight`` it takes (``None``: any).
    ``auto_on``: the device types on which ``"auto"`` picks it (``AUTO_ORDER``; ``None``:
    any). ``chunk_size``: whether it honours ``chunk_size=`` (at most that many tokens,
    up to the rounding its docstring states, have logits at once); one that does not is a
    ``ValueError`` when asked by name with a ``chunk_size``, and ``"auto"`` never picks it
    then.
    Shape limits (e.g. int32 offsets) are not here: they are a check on each call
    (``FusedLossEngine.unsupported``).
    """

    module: str
    install: str
    needs: tuple[str, ...] = ()
    devices: tuple[str, ...] | None = None
    interpreted: tuple[str, str] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    auto_on: tuple[str, ...] | None = None
    chunk_size: bool = True

    def unsupported(self, device: torch.device, dtypes: tuple[torch.dtype, ...]) -> str | None:
        """Why this engine cannot run tensors of ``device`` and ``dtypes``, or ``None``."""
        devices = self.devices
        if devices is not None and self.interpreted is not None:
            variable, interpreted = self.interpreted
            if os.environ.get(variable) == "1":
                devices = (*devices, interpreted)
        if devices is not None and device.type not in devices:
            extra = ""
            if self.interpreted is not None:
                extra = f" ({self.interpreted[1]} only under {self.interpreted[0]}=1)"
            return f"{device.type} tensors (it runs {', '.join(devices)} tensors{extra})"
        for dtype in dtypes:
            if self.dtypes is not None and dtype not in self.dtypes:
                names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
                return f"dtype {dtype} (it takes {names})"
        return None


#: Engine name -> its static capabilities.
ENGINE_CAPS: dict[str, EngineCaps] = {
    "torch": EngineCaps("mp_bridge.layers.loss.engines.torch_ops", "it ships with mp_bridge"),
    "triton": EngineCaps(
        "mp_bridge.layers.loss.engines.triton_ops",
        "pip install triton",
        needs=("triton",),
        devices=("cuda",),
        interpreted=("TRITON_INTERPRET", "cpu"),
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        auto_on=("cuda",),
    ),
}

#: The choices of ``engine=`` on the fused doors.
ENGINES = ("auto", *ENGINE_CAPS)

#: What ``"auto"`` tries, in order: the first engine whose ``auto_on`` holds the device
#: type and that can run the call; ``"torch"`` runs every call.
AUTO_ORDER = ("triton", "torch")


def engine_module(name: str) -> ModuleType:
    """The module of engine ``name`` (imported on first use, then cached by Python).

    ``ImportError`` naming the engine and how to install it when the module or a package
    it needs (``triton``) does not import.
    """
    caps = ENGINE_CAPS[name]
    try:
        return importlib.import_module(caps.module)
    except ImportError as exc:
        raise ImportError(
            f"engine={name!r} is unavailable here ({exc}): {caps.install} (the GPU engine's "
            "kernels; its tests run on CPU under TRITON_INTERPRET=1), or pass "
            "engine='torch'"
        ) from exc
