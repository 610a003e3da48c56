"""The invariant runner's per-group steps (no collectives): the in-place add of the tree
folds, moving a fold's surviving nodes out of the reused product buffer, and the
d-weight accumulation of one group of blocks, ``WEIGHT_GRAD_ROWS`` tokens at a time."""

from __future__ import annotations

import torch

from mp_bridge.layers.loss.blocks import BLOCK_GROUP, TOKEN_TILE, WEIGHT_GRAD_ROWS, BlockGroup
from mp_bridge.layers.loss.tree import StreamFold

__all__ = ["add_", "add_weight_grad", "settle"]


def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` into ``x`` (the combine of the invariant runner's tree folds)."""
    return x.add_(y)


def settle(fold: StreamFold, slots: list[torch.Tensor]) -> None:
    """Move the values of ``fold.stack`` that are not yet in their position's slot (views of
    the product buffer about to be overwritten) into ``slots[position]`` (made on first
    use); a merged node already sits in its left operand's slot (``add_`` is in place)."""
    for p, (piece, v) in enumerate(fold.stack):
        if p == len(slots):
            slots.append(torch.empty_like(v))
        if v is not slots[p]:
            fold.stack[p] = (piece, slots[p].copy_(v))


def add_weight_grad(acc, gg, hi, grp: BlockGroup) -> None:
    """``acc [>= G, B, Hp] += gg^T @ hi`` for the blocks ``grp`` adds: one ``G x (B,
    WEIGHT_GRAD_ROWS) @ (WEIGHT_GRAD_ROWS, Hp)`` product per ``WEIGHT_GRAD_ROWS`` tokens of
    the tile, in token order; ``baddbmm_`` in fp32 (``bmm`` then add in a low input dtype,
    which ``baddbmm_`` cannot mix with an fp32 ``acc``)."""
    if grp.lo:  # a window: its first slots are done; their rows of g add exact zeros
        gg = gg.clone()
        gg[: grp.lo] = 0.0
    target = acc[grp.start : grp.start + BLOCK_GROUP]
    for r in range(0, TOKEN_TILE, WEIGHT_GRAD_ROWS):
        g_r, h_r = gg[:, r : r + WEIGHT_GRAD_ROWS].transpose(1, 2), hi[:, r : r + WEIGHT_GRAD_ROWS]
        if gg.dtype == torch.float32:
            target.baddbmm_(g_r, h_r)
        else:
            target.add_(torch.bmm(g_r, h_r))
