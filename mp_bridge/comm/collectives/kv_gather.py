"""The CP K/V all-gather of context-parallel attention, and its adjoint, as autograd Functions.

``kv`` is ``[2, b, s, hk, d]`` (K and V stacked) on each of the ``n`` CP ranks; ``pos`` is
the int64 ``[pb, s]`` original positions of the local tokens (``[pb, 0]`` when none are
needed). Collectives (CP group of size ``n > 1``):

- ``GatherKV`` forward: **one** all-gather of a per-rank byte buffer ``[pos | kv]``, so the
  positions cost no extra round trip; returns ``kv_all [2, b, n·s, hk, d]`` and
  ``pos_all [pb, n·s]`` (rank-major along the sequence; ``pos_all`` is not differentiable).
  Backward: ``ReduceScatterKV`` (every rank's queries contribute to every key's gradient).
- ``ReduceScatterKV`` forward: **one** reduce-scatter(SUM) of ``[2, b, n·s, hk, d]`` back to
  ``[2, b, s, hk, d]``. Backward: ``GatherKV`` (K/V only), so double backward is correct.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm.collectives.primitives import (
    all_gather_tensor,
    group_size,
    reduce_scatter_tensor,
)

__all__ = ["GatherKV", "ReduceScatterKV", "gather_kv"]


def _no_positions(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, 0, dtype=torch.int64, device=like.device)


class GatherKV(torch.autograd.Function):
    """All-gather ``kv [2, b, s, hk, d]`` and ``pos [pb, s]`` over CP in one collective."""

    @staticmethod
    def forward(ctx, kv, pos, group):
        ctx.group = group
        n = group_size(group)
        two, b, s, hk, d = kv.shape
        pos_bytes = pos.contiguous().reshape(-1).view(torch.uint8)
        kv_bytes = kv.contiguous().reshape(-1).view(torch.uint8)
        buf = torch.cat([pos_bytes, kv_bytes]).unsqueeze(0)
        gathered = all_gather_tensor(buf, group, 0)  # [n, nbytes]
        npos = pos_bytes.numel()
        pb = pos.shape[0]
        if npos:
            pos_all = gathered[:, :npos].contiguous().view(torch.int64).view(n, pb, s)
            pos_all = pos_all.permute(1, 0, 2).reshape(pb, n * s)
        else:  # non-causal call: no positions sent
            pos_all = pos.new_empty(pb, 0)
        kv_all = gathered[:, npos:].contiguous().view(kv.dtype).view(n, two, b, s, hk, d)
        kv_all = kv_all.permute(1, 2, 0, 3, 4, 5).reshape(two, b, n * s, hk, d)
        ctx.mark_non_differentiable(pos_all)
        return kv_all, pos_all

    @staticmethod
    def backward(ctx, grad_kv, _grad_pos):
        return ReduceScatterKV.apply(grad_kv, ctx.group), None, None


class ReduceScatterKV(torch.autograd.Function):
    """Reduce-scatter(SUM) ``[2, b, n·s, hk, d]`` (rank-major sequence) to ``[2, b, s, hk, d]``."""

    @staticmethod
    def forward(ctx, kv_all, group):
        ctx.group = group
        n = group_size(group)
        two, b, ns, hk, d = kv_all.shape
        per_rank = kv_all.reshape(two, b, n, ns // n, hk, d).permute(2, 0, 1, 3, 4, 5)
        grad = reduce_scatter_tensor(per_rank.contiguous(), group, 0)  # [1, 2, b, s, hk, d]
        return grad.squeeze(0)

    @staticmethod
    def backward(ctx, grad):
        kv_all, _ = GatherKV.apply(grad, _no_positions(grad), ctx.group)
        return kv_all, None


def gather_kv(
    kv: torch.Tensor, pos: torch.Tensor | None, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(kv_all, pos_all)``: K/V ``[2, b, s, hk, d]`` and int64 positions ``[pb, s]`` (or
    ``None``) gathered over ``group`` in one all-gather; identity for a group of size 1.

    Backward reduce-scatters the K/V gradient (see the module docstring).
    """
    if group_size(group) == 1:
        return kv, pos
    kv_all, pos_all = GatherKV.apply(kv, _no_positions(kv) if pos is None else pos, group)
    return kv_all, (None if pos is None else pos_all)
