"""The torch engine's autograd Function: the chunk loop over a ``ChunkEngine`` (``chunks``).

Gradient strategy (memory vs compute):

- ``reduction="sum" | "mean"``: gradients are computed **during forward**, chunk by chunk,
  while the chunk's logits are alive (Liger-style): 3 matmuls per chunk, like the
  materialized path, at the cost of holding fp32 ``d hidden [N, H]`` and ``d weight
  [V_local, H]`` from forward to backward, where they are scaled by the upstream scalar
  (divided by the number of non-ignored tokens for "mean"). Skipped under ``no_grad``.
- ``reduction="none"`` and log-probs: the per-token upstream gradients are unknown in
  forward, and ``d weight`` is not a per-row rescaling of anything storable, so forward
  keeps only ``lse [N]`` and backward recomputes each chunk's logits (4 matmuls per chunk).

At most one chunk's logits exist at a time; statistics and gradients accumulate in fp32.
"""

from __future__ import annotations

import torch

from mp_bridge.layers.loss.arguments import forbid_double_backward
from mp_bridge.layers.loss.engines.torch.chunks import ChunkEngine

__all__ = ["FusedLinearLoss", "chunks"]


class FusedLinearLoss(torch.autograd.Function):
    """The chunk driver. Adjoint: ``d hidden`` rows reduced over TP by the chunk engine,
    ``d weight`` local to the shard. See the module docstring for when each is computed.
    Returns ``(values, extra, sq)``: ``extra`` the per-token entropy with
    ``spec.entropy``, else the z-loss reduced like the values (no gradient), else empty;
    ``sq`` the per-token ``sum p**2`` with ``spec.sum_pi_squared`` (no gradient; only
    with ``reduction="none"``), else empty. ``temp``: fp32 per-token temperature ``[N]``
    or ``None`` (``spec.temperature``)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, engine: ChunkEngine, spec, chunk, reduction, needs_grad, temp
    ):
        n, h_dim = hidden.shape
        eager = needs_grad and reduction != "none"
        w = spec.token_weight(target, temp)
        values = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros_like(values)
        entropy = torch.zeros_like(values) if spec.entropy else None
        sq = torch.zeros_like(values) if spec.sum_pi_squared else None
        gh = hidden.new_zeros((n, h_dim), dtype=torch.float32) if eager else None
        # No [V_local, H] buffer when the weight is frozen (d hidden is still reduced).
        eager_w = eager and ctx.needs_input_grad[1]
        gw = weight.new_zeros(weight.shape, dtype=torch.float32) if eager_w else None
        for rows in chunks(n, chunk):
            res = engine.forward_chunk(
                hidden[rows], target[rows], temp=None if temp is None else temp[rows]
            )
            values[rows], lse[rows] = res.value, res.lse
            if entropy is not None:
                entropy[rows] = res.entropy
            if sq is not None:
                sq[rows] = res.sum_pi_squared
            if eager:
                gh[rows] = engine.grad_chunk(
                    res.state, hidden[rows], target[rows], lse[rows], w[rows], gw
                )
            del res  # free this chunk's logits before the next chunk's exist
        z_loss = lse * lse * spec.z_loss_weight if spec.z_loss_weight != 0.0 else None
        if spec.ignore_index is not None:
            ignored = target == spec.ignore_index
            values.masked_fill_(ignored, 0.0)
            for v in (entropy, z_loss, sq):
                if v is not None:
                    v.masked_fill_(ignored, 0.0)
        ctx.setup = (engine, spec, chunk, reduction, eager)
        ctx.grads = (gh, gw)
        ctx.save_for_backward(hidden, weight, target, lse, entropy, temp)
        sq = sq if sq is not None and reduction == "none" else values.new_zeros(0)
        if reduction == "none":
            return values, _extra(ctx, values, entropy, z_loss, sq), sq
        total = values.sum()
        z_total = None if z_loss is None else z_loss.sum()
        if reduction == "mean":
            count = (w != 0).sum().to(torch.float32)
            # Every gradient is 0 when no token counts: divide it by 1, not 0 (no nan).
            ctx.count = count.clamp(min=1.0)
            # nan when every token is ignored, like F.cross_entropy
            z_total = None if z_total is None else z_total / count
            return total / count, _extra(ctx, total, None, z_total, sq), sq
        return total, _extra(ctx, total, None, z_total, sq), sq

    @staticmethod
    def backward(ctx, grad_out, grad_extra, grad_sq):
        forbid_double_backward("fused_linear_cross_entropy / fused_linear_logprobs")
        hidden, weight, target, lse, entropy, temp = ctx.saved_tensors
        engine, spec, chunk, reduction, eager = ctx.setup
        if eager:
            gh, gw = ctx.grads
            if gh is None:
                raise RuntimeError(
                    f"backward ran twice through fused_linear_cross_entropy(reduction="
                    f"{reduction!r}) (retain_graph=True): its gradients are computed in forward "
                    "and consumed by the first backward; call the loss again, or use "
                    "reduction='none' (recomputes in backward) and reduce it yourself"
                )
            ctx.grads = (None, None)
            scale = grad_out.float() / ctx.count if reduction == "mean" else grad_out.float()
            gh.mul_(scale)  # in place: these buffers belong to this call alone
            if gw is not None:
                gw.mul_(scale)
        else:
            token = spec.token_weight(target, temp)
            w = token * grad_out.float()
            w_ent = token * grad_extra.float() if spec.entropy else None
            gh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            gw = None
            if ctx.needs_input_grad[1]:
                gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for rows in chunks(hidden.shape[0], chunk):
                state = engine.recompute(hidden[rows], None if temp is None else temp[rows])
                extra = {}
                if spec.entropy:
                    extra = {"entropy": entropy[rows], "w_ent": w_ent[rows]}
                gh[rows] = engine.grad_chunk(
                    state, hidden[rows], target[rows], lse[rows], w[rows], gw, **extra
                )
                del state
        grad_h = gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = gw.to(weight.dtype) if gw is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def _extra(ctx, like, entropy, z_loss, sq) -> torch.Tensor:
    """The entropy, else the z-loss, else empty; marks it (unless the entropy) and ``sq``
    non-differentiable in one call (a second call would replace the first's set)."""
    if entropy is not None:
        ctx.mark_non_differentiable(sq)
        return entropy
    out = z_loss if z_loss is not None else like.new_zeros(0)
    ctx.mark_non_differentiable(out, sq)
    return out


def chunks(n: int, chunk: int):
    """The row slices of ``n`` rows, ``chunk`` at a time (the last one shorter)."""
    for s in range(0, n, chunk):
        yield slice(s, min(s + chunk, n))
