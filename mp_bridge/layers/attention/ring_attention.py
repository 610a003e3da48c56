"""Ring attention over a CP group: K/V blocks circulate, each step overlaps the next transfer.

Rank ``r`` of ``n`` holds ``q, k, v [b, s, h, d]``. Forward, step ``t = 0 .. n−1``: the K/V
block of rank ``j = r − t`` is in hand; the transfer of the next (``RingStep``: ``irecv``
from ``r − 1``, ``isend`` to ``r + 1``) is posted *before* the block's pieces run, so it
overlaps them. At most two K/V blocks are held at once (in hand and arriving).
Backward: K/V circulate again in the same order; the ``dK/dV`` partial of block ``j``
travels one hop behind it, gathering each rank's contribution, and its last hop lands on
``j`` (whose own contribution was computed at step 0).

Collectives per call (``n > 1``): forward ``n − 1`` send/recv pairs of the K/V block
(``2·b·s·hk·d`` elements each: the bytes of ``comm="all_gather"``'s all-gather);
backward ``n − 1`` of K/V and ``n − 1`` of ``dK/dV`` (in the K/V dtype: 2x the forward
bytes). ``dq`` and each rank's partials accumulate in fp32; a bf16 ``dK/dV`` is rounded
once per hop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import forbid_double_backward
from mp_bridge.comm import RingStep, group_rank, group_size
from mp_bridge.layers.attention.local_attention import heads_first
from mp_bridge.layers.attention.merge import LseMerge, PositionMask, pieces_backward, pieces_forward
from mp_bridge.layers.attention.pieces import BlockPair

__all__ = ["ring_attention"]


def _kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return heads_first(kv[0]), heads_first(kv[1])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plans, scale, masks, group):
        n, r, s = group_size(group), group_rank(group), q.shape[1]
        qh = heads_first(q)
        b, hq, _, d = qh.shape
        merge = LseMerge(b, hq, s, d, q.device)
        cur = torch.stack([k, v])  # [2, b, s, hk, d]
        for t in range(n):
            j = (r - t) % n
            step = RingStep(cur, torch.empty_like(cur), group) if t < n - 1 else None
            kh, vh = _kv_views(cur)
            pieces_forward(merge, qh, kh, vh, plans[j], scale=scale, masks=masks, k_shift=j * s)
            if step is not None:
                cur = step.wait()
        out = merge.output().to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merge.lse)
        ctx.plans, ctx.scale, ctx.masks, ctx.group = plans, scale, masks, group
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("context_parallel_attention", "its fused kernels' backward")
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        n, r, s = group_size(group), group_rank(group), q.shape[1]
        qh, gh = heads_first(q), heads_first(grad_out)
        dq = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)
        cur = torch.stack([k, v])
        own = arriving = None
        for t in range(n):
            j = (r - t) % n
            step = RingStep(cur, torch.empty_like(cur), group) if t < n - 1 else None
            kh, vh = _kv_views(cur)
            part = torch.zeros((2, *kh.shape), dtype=torch.float32, device=q.device)
            pieces_backward(
                gh, qh, kh, vh, out, lse, ctx.plans[j], (dq, part[0], part[1]),
                scale=ctx.scale, masks=ctx.masks, k_shift=j * s,
            )  # fmt: skip
            if t == 0:
                own = part
            else:
                if arriving is not None:  # the partial of block j from ranks j+1 .. r-1
                    part += arriving.wait().float().transpose(2, 3)
                send = part.to(k.dtype).transpose(2, 3)  # [2, b, s, hk, d], like cur
                arriving = RingStep(send, torch.empty_like(cur), group)
            if step is not None:
                cur = step.wait()
        if arriving is not None:  # block r's partial from every other rank
            own += arriving.wait().float().transpose(2, 3)
        dk, dv = (heads_first(g).to(k.dtype) for g in own)
        return heads_first(dq).to(q.dtype), dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plans: list[list[BlockPair]],
    *,
    scale: float,
    group: dist.ProcessGroup | None,
    masks: PositionMask | None = None,
) -> torch.Tensor:
    """``[b, s, hq, d]``: ring attention; ``plans[j]``: the pieces against rank ``j``'s K/V
    block (key rows in the gathered numbering ``j·s + local``)."""
    return _RingAttention.apply(q, k, v, plans, scale, masks, group)
