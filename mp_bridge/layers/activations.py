"""The activations the model configs name, by their Hugging Face spelling.

``"gelu"``: erf GELU (LLaVA's projector, the tiny model); ``"quick_gelu"``: CLIP's
``x·sigmoid(1.702·x)``; ``"gelu_pytorch_tanh"``: SigLIP's tanh-approximated GELU;
``"silu"``: the SwiGLU gate of Llama / Qwen2 / Mistral. Pure elementwise functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "activation"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function called ``name`` (``ValueError`` listing the known names)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
