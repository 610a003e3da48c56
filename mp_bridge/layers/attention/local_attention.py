"""Attention of the queries in hand over the keys in hand, piece by piece (autograd).

``q [b, s_q, hq, d]``, ``k, v [b, s_k, hk, d]`` (``hq % hk == 0``; grouped heads go to the
kernel as they are) and the host-side list of pieces (:mod:`.pieces`). Forward: one fused
kernel call per piece, merged by LSE in fp32 (:mod:`.merge`); output ``[b, s_q, hq, d]``
in ``q.dtype``. Backward: each piece's kernel backward with the merged output and LSE,
``dq, dk, dv`` summed in fp32 and returned in the inputs' dtypes. No collective; nothing
of ``s_q × s_k`` elements is built (a ``MASKED`` piece's mask is one block pair).
``create_graph=True`` through it raises (the kernels' backward has no derivative).
"""

from __future__ import annotations

import numpy as np
import torch

from mp_bridge.checks import forbid_double_backward
from mp_bridge.layers.attention.block_kernels import block_backward
from mp_bridge.layers.attention.merge import LseMerge, PositionMask, pieces_backward, pieces_forward
from mp_bridge.layers.attention.pieces import CAUSAL, MASKED, BlockPair, covered_once

__all__ = ["heads_first", "local_attention"]


def heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` as the kernels' ``[b, h, s, d]`` (a view)."""
    return t.transpose(1, 2)


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pieces, scale, masks):
        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
        b, hq, s, d = qh.shape
        rows_once, keys_once = covered_once(pieces, s, k.shape[1])
        merge = LseMerge(b, hq, s, d, q.device, q.dtype if rows_once else torch.float32)
        pieces_forward(merge, qh, kh, vh, pieces, scale=scale, masks=masks)
        out = merge.output().to(q.dtype)  # [b, hq, s, d]
        ctx.save_for_backward(q, k, v, out, merge.lse)
        ctx.pieces, ctx.scale, ctx.masks = pieces, scale, masks
        ctx.once = rows_once, keys_once
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("context_parallel_attention", "its fused kernels' backward")
        q, k, v, out, lse = ctx.saved_tensors
        qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
        only = ctx.pieces[0] if len(ctx.pieces) == 1 else None
        if only is not None and (only.q0, only.q1, only.k0, only.k1) == (
            0,
            q.shape[1],
            0,
            k.shape[1],
        ):
            if only.kind != MASKED:  # one kernel covers everything: its gradients as they are
                dq, dk, dv = block_backward(
                    heads_first(grad_out), qh, kh, vh, out, lse, causal=only.kind == CAUSAL,
                    scale=ctx.scale,
                )  # fmt: skip
                return heads_first(dq), heads_first(dk), heads_first(dv), None, None, None
        # fp32 sums, or, where every row is in one pair, the input dtype, the piece's
        # gradient copied in and only the rows no pair covers zeroed
        once = (ctx.once[0], ctx.once[1], ctx.once[1])
        grads = tuple(
            _grad_buffer(t, one, ctx.pieces, keys=i > 0)
            for i, (t, one) in enumerate(zip((qh, kh, vh), once))
        )
        pieces_backward(
            heads_first(grad_out), qh, kh, vh, out, lse, ctx.pieces, grads,
            scale=ctx.scale, masks=ctx.masks, assign=ctx.once,
        )  # fmt: skip
        dq, dk, dv = (heads_first(g).to(t.dtype) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None


def _grad_buffer(t: torch.Tensor, once: bool, pieces: list[BlockPair], *, keys: bool):
    """``[b, h, s, d]`` for the gradient of ``t`` (heads first): zeros in fp32 where pieces
    sum; where each row is in at most one piece (``once``), uninitialized in ``t``'s dtype
    but for the rows no piece covers, zeroed here (the pieces copy in the rest)."""
    if not once:
        return torch.zeros(t.shape, dtype=torch.float32, device=t.device)
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    covered = np.zeros(t.shape[2], dtype=bool)
    for p in pieces:
        if keys:
            covered[p.k0 : p.k1] = True
        else:
            covered[p.q0 : p.q1] = True
    for start, stop in _runs_of(~covered):
        out[:, :, start:stop].zero_()
    return out


def _runs_of(flags: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of True in ``flags``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: list[BlockPair],
    *,
    scale: float,
    masks: PositionMask | None = None,
) -> torch.Tensor:
    """``[b, s_q, hq, d]``: the queries over the keys in hand, as ``pieces`` say."""
    return _LocalAttention.apply(q, k, v, pieces, scale, masks)
