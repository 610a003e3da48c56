"""Every random-number generator state of this process, captured and restored.

``capture()`` -> a picklable dict: torch's CPU generator, every CUDA device's generator
(only when CUDA is already initialized: capturing must not start CUDA), python
``random`` and numpy's global generator. ``restore(state)`` puts them back, so the next
random draw equals the one the saved run made next (a bitwise resume). No collective.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["capture", "restore"]


def capture() -> dict:
    """This process's generator states (copies: later draws do not change them)."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    """Set this process's generators to ``state`` (a :func:`capture` result). CUDA states
    are restored when this process has CUDA and as many devices as were saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
