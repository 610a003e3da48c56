"""Autograd guards shared by every hand-written ``backward``."""

from __future__ import annotations

import torch

__all__ = ["forbid_double_backward"]


def forbid_double_backward(name: str, why: str = "its backward runs outside autograd") -> None:
    """Raise in a ``backward`` run with ``create_graph=True`` (grad mode is on there).

    For autograd Functions whose backward is not built from differentiable ops (a collective
    outside autograd, or forward statistics reused as constants): a graph recorded through
    it would give a silently wrong second derivative. ``why`` says which, for the message.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} cannot differentiate twice: backward(create_graph=True) is not supported "
            f"({why}, so a second derivative would be wrong); call backward() without "
            "create_graph"
        )
