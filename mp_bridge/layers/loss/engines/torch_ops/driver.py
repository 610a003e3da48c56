"""The torch engine's autograd Function: the chunk loop over a mode's ``ChunkRunner``.

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

from typing import NamedTuple, Protocol

import torch

from mp_bridge.layers.loss.arguments import forbid_double_backward
from mp_bridge.layers.loss.outputs import TokenOutputs

__all__ = ["ChunkRunner", "ChunkState", "FusedLinearLoss", "chunks"]


class ChunkState(NamedTuple):
    """A chunk's logits kept from ``forward_chunk`` / ``recompute`` for ``grad_chunk``.

    ``logits`` holds ``exp(z - row_max)`` when ``row_max`` is set, else the transformed
    fp32 logits ``z``; ``tiles`` is the invariant runner's ``[T, TOKEN_TILE, H]`` copy of
    ``h`` (``None`` in the default runner); ``deriv`` the soft-cap derivative (or ``None``).
    """

    logits: torch.Tensor
    row_max: torch.Tensor | None
    tiles: torch.Tensor | None = None
    deriv: torch.Tensor | None = None


class ChunkRunner(Protocol):
    """What the chunk driver (``FusedLinearLoss``) needs from the runner of a mode
    (``default.TorchDefaultRunner``, ``invariant.TorchInvariantRunner``).

    A runner turns one token chunk ``h [C, H]`` of the TP-replicated hidden states and
    the local weight shard ``W [V_local, H]`` into per-token outputs (``forward_chunk``),
    and a chunk's logits plus per-token factors into the full ``d loss / d h`` rows and
    this rank's ``d loss / d W`` (``grad_chunk``, accumulated in fp32). Only the chunk's
    logits are ever alive (plus, invariant, O(log blocks) ``[TOKEN_TILE, H]`` fp32
    partials). Collectives (``reduce``): default, one stats all-gather and one ``d h``
    all-reduce; invariant, both folded in the canonical tree.
    """

    def forward_chunk(
        self, h: torch.Tensor, t: torch.Tensor, temp: torch.Tensor | None = None
    ) -> tuple[ChunkState, TokenOutputs]:
        """The state and unmasked ``TokenOutputs`` (``lse`` included) of chunk ``h [C, H]``
        with targets ``t [C]`` (collectives); ``temp [C]``: the fp32 per-token
        temperature, or ``None`` (``spec.temperature``)."""

    def recompute(self, h: torch.Tensor, temp: torch.Tensor | None = None) -> ChunkState:
        """The chunk's logits again (backward of ``reduction="none"``); no collective."""

    def grad_chunk(
        self,
        state: ChunkState,
        h: torch.Tensor,
        t: torch.Tensor,
        lse: torch.Tensor,
        w: torch.Tensor,
        gw: torch.Tensor | None,
        *,
        entropy: torch.Tensor | None = None,
        w_ent: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``d loss / d h [C, H]`` fp32 for per-token factors ``w [C]`` (and ``w_ent [C]``
        of the entropy, with ``spec.entropy``); ``gw += d W``."""


class FusedLinearLoss(torch.autograd.Function):
    """The chunk driver. Adjoint: ``d hidden`` rows reduced over TP by the chunk runner,
    ``d weight`` local to the shard. See the module docstring for when each is computed.
    Returns the ``TokenOutputs.tensors``: per token with ``reduction="none"``, else the
    value and the z-loss reduced (the other outputs are asked only with "none").
    ``temp``: fp32 per-token temperature ``[N]`` or ``None`` (``spec.temperature``)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, runner: ChunkRunner, spec, chunk, reduction, needs_grad, temp
    ):
        n, h_dim = hidden.shape
        eager = needs_grad and reduction != "none"
        w = spec.token_weight(target, temp)
        out = spec.zero_outputs(n, hidden.device)  # fp32 [N] of every output, lse included
        gh = hidden.new_zeros((n, h_dim), dtype=torch.float32) if eager else None
        # No [V_local, H] buffer when the weight is frozen (d hidden is still reduced).
        eager_w = eager and ctx.needs_input_grad[1]
        gw = weight.new_zeros(weight.shape, dtype=torch.float32) if eager_w else None
        for rows in chunks(n, chunk):
            state, res = runner.forward_chunk(
                hidden[rows], target[rows], temp=None if temp is None else temp[rows]
            )
            for buf, v in zip(out, res, strict=True):
                if buf is not None:
                    buf[rows] = v
            if eager:
                gh[rows] = runner.grad_chunk(
                    state, hidden[rows], target[rows], out.lse[rows], w[rows], gw
                )
            del state, res  # free this chunk's logits before the next chunk's exist
        lse = out.lse
        if spec.ignore_index is not None:
            out = out.masked(target == spec.ignore_index)
        ctx.setup = (runner, spec, chunk, reduction, eager)
        ctx.grads = (gh, gw)
        ctx.save_for_backward(hidden, weight, target, lse, out.entropy, temp)
        if reduction == "none":
            return out.tensors(ctx)
        total = out.value.sum()
        z_total = None if out.z_loss is None else out.z_loss.sum()
        if reduction == "mean":
            count = (w != 0).sum().to(torch.float32)
            # Every gradient is 0 when no token counts: divide it by 1, not 0 (no nan).
            ctx.count = count.clamp(min=1.0)
            # nan when every token is ignored, like F.cross_entropy
            total = total / count
            z_total = None if z_total is None else z_total / count
        return TokenOutputs(total, None, z_total).tensors(ctx)

    @staticmethod
    def backward(ctx, grad_out, grad_entropy, grad_z_loss, grad_sq):
        forbid_double_backward("fused_linear_cross_entropy / fused_linear_logprobs")
        hidden, weight, target, lse, entropy, temp = ctx.saved_tensors
        runner, spec, chunk, reduction, eager = ctx.setup
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
            w_ent = token * grad_entropy.float() if spec.entropy else None
            gh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            gw = None
            if ctx.needs_input_grad[1]:
                gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for rows in chunks(hidden.shape[0], chunk):
                state = runner.recompute(hidden[rows], None if temp is None else temp[rows])
                extra = {}
                if spec.entropy:
                    extra = {"entropy": entropy[rows], "w_ent": w_ent[rows]}
                gh[rows] = runner.grad_chunk(
                    state, hidden[rows], target[rows], lse[rows], w[rows], gw, **extra
                )
                del state
        grad_h = gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = gw.to(weight.dtype) if gw is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None


def chunks(n: int, chunk: int):
    """The row slices of ``n`` rows, ``chunk`` at a time (the last one shorter)."""
    for s in range(0, n, chunk):
        yield slice(s, min(s + chunk, n))
