"""Fused LM-head cross-entropy / log-probs: hidden states + vocab shard -> loss, no logits.

``hidden [N, H]`` is TP-replicated (identical on every rank of ``tp_group``), ``weight
[V_local, H]`` is this rank's ``VocabShard`` of the padded vocab (ids ``>= vocab_size``
are padding and never enter a softmax: the layout of ``VocabParallelLMHead`` or a tied
``VocabParallelEmbedding``), ``target [N]``. Tokens are processed in chunks of
``chunk_size`` rows by a ``ChunkEngine`` (``fused_engines``); at most one chunk's fp32
logits ``[chunk, V_local]`` exist at a time and the weight is never gathered. Statistics
and gradients accumulate in fp32 whatever the input dtype; outputs are fp32.

Gradient strategy (memory vs compute):

- ``reduction="sum" | "mean"``: gradients are computed **during forward**, chunk by chunk,
  while the chunk's logits are alive (Liger-style): 3 matmuls per chunk, like the
  materialized path, at the cost of holding fp32 ``d hidden [N, H]`` and ``d weight
  [V_local, H]`` from forward to backward, where they are scaled by the upstream scalar
  (divided by the number of non-ignored tokens for "mean"). Skipped under ``no_grad``.
- ``reduction="none"`` and log-probs: the per-token upstream gradients are unknown in
  forward, and ``d weight`` is not a per-row rescaling of anything storable, so forward
  keeps only ``lse [N]`` and backward recomputes each chunk's logits (4 matmuls per chunk).

Collectives per chunk over ``tp_group`` (``k = ceil(N / chunk)`` chunks; the shapes are
in ``loss_reduce``): default, one stats all-gather and one ``d hidden`` all-reduce;
``invariant=True``, one stats all-gather and one ``d hidden`` all-gather of subtree
partials. ``invariant=True`` rounds ``chunk`` up to a multiple of ``TOKEN_TILE``; values
and gradients are then bitwise identical for every TP size whose shard is a multiple of
``VOCAB_BLOCK`` rows (at TP = 1 any ``[V, H]`` weight: it is zero-padded to whole blocks
by one copy), for any ``chunk_size``, and whatever other tokens share the call; ``d
weight`` sums tokens tile by tile in token order, so it is also unchanged by extra tokens
appended with zero upstream gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .fused_engines import ChunkEngine, DefaultEngine, InvariantEngine
from .loss_blocks import TOKEN_TILE, BlockLayout, pad_single_shard
from .loss_checks import (
    check_bool,
    check_fused_inputs,
    check_loss_args,
    check_reduction,
    check_shard,
    check_target,
    check_temperature,
    check_tp_agreement,
    forbid_double_backward,
)
from .loss_math import LossSpec

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "fused_linear_cross_entropy", "fused_linear_logprobs"]

#: Default chunk: about this many fp32 logits (8 MiB) per chunk, at least 128 rows (a
#: smaller matmul loses BLAS efficiency); with the fp32 d weight it keeps the peak far
#: below the materialized [N, V_local] logits and their gradient at TP 1-8.
DEFAULT_CHUNK_ELEMENTS = 1 << 21


class _FusedLinearLoss(torch.autograd.Function):
    """The chunk driver. Adjoint: ``d hidden`` rows reduced over TP by the engine, ``d
    weight`` local to the shard. See the module docstring for when each is computed."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, engine: ChunkEngine, spec, chunk, reduction, needs_grad
    ):
        n, h_dim = hidden.shape
        eager = needs_grad and reduction != "none"
        w = spec.token_weight(target)
        values = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse = torch.zeros_like(values)
        gh = hidden.new_zeros((n, h_dim), dtype=torch.float32) if eager else None
        # No [V_local, H] buffer when the weight is frozen (d hidden is still reduced).
        eager_w = eager and ctx.needs_input_grad[1]
        gw = weight.new_zeros(weight.shape, dtype=torch.float32) if eager_w else None
        for rows in _chunks(n, chunk):
            state, values[rows], lse[rows] = engine.forward_chunk(hidden[rows], target[rows])
            if eager:
                gh[rows] = engine.grad_chunk(
                    state, hidden[rows], target[rows], lse[rows], w[rows], gw
                )
            del state  # free this chunk's logits before the next chunk's exist
        if spec.ignore_index is not None:
            values.masked_fill_(target == spec.ignore_index, 0.0)
        ctx.setup = (engine, spec, chunk, reduction, eager)
        ctx.grads = (gh, gw)
        ctx.save_for_backward(hidden, weight, target, lse)
        if reduction == "none":
            return values
        total = values.sum()
        if reduction == "mean":
            count = (w != 0).sum().to(torch.float32)
            # Every gradient is 0 when no token counts: divide it by 1, not 0 (no nan).
            ctx.count = count.clamp(min=1.0)
            return total / count  # nan when every token is ignored, like F.cross_entropy
        return total

    @staticmethod
    def backward(ctx, grad_out):
        forbid_double_backward("fused_linear_cross_entropy / fused_linear_logprobs")
        hidden, weight, target, lse = ctx.saved_tensors
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
            w = spec.token_weight(target) * grad_out.float()
            gh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            gw = None
            if ctx.needs_input_grad[1]:
                gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for rows in _chunks(hidden.shape[0], chunk):
                state = engine.recompute(hidden[rows])
                gh[rows] = engine.grad_chunk(
                    state, hidden[rows], target[rows], lse[rows], w[rows], gw
                )
                del state
        grad_h = gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = gw.to(weight.dtype) if gw is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


def _chunks(n: int, chunk: int):
    for s in range(0, n, chunk):
        yield slice(s, min(s + chunk, n))


def _fused_loss(
    hidden, weight, target, spec_of, *, tp_group, vocab_size, chunk_size, invariant, reduction
):
    """Validate everything (before any collective), build the engine and run the loss.

    ``spec_of(vocab_size) -> LossSpec`` once the true vocab size is known.
    """
    check_fused_inputs(hidden, weight, chunk_size)
    v_local = weight.shape[0]
    shard = check_shard(v_local, vocab_size, tp_group)
    spec = spec_of(shard.vocab_size)
    target = check_target(
        target,
        (hidden.shape[0],),
        spec.vocab_size,
        spec.ignore_index,
        shape_of="[N] of hidden [N, H]: ",
    )
    if chunk_size is None:
        chunk_size = max(128, DEFAULT_CHUNK_ELEMENTS // v_local)
    chunk = max(1, min(chunk_size, hidden.shape[0]))
    check_tp_agreement(  # under MP_BRIDGE_CHECK: one all-gather, before the chunk loop
        "fused linear loss",
        tp_group,
        {"hidden": hidden, "weight": weight},
        {"spec": spec, "chunk": chunk, "invariant": invariant, "reduction": reduction},
        {"hidden": hidden, "target": target},
    )
    if check_bool("invariant", invariant):
        layout = BlockLayout.of_shard(shard)
        chunk = -(-chunk // TOKEN_TILE) * TOKEN_TILE  # tiles must not depend on the chunk
        # TP = 1 with a vocab that is not a whole number of blocks: one zero-padded copy.
        weight = pad_single_shard(weight, 0, layout)
        engine: ChunkEngine = InvariantEngine(weight, tp_group, layout, spec)
    else:
        engine = DefaultEngine(weight, tp_group, shard, spec)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearLoss.apply(
        hidden, weight, target, engine, spec, chunk, reduction, needs_grad
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ full_weight[:vocab_size].T`` without materializing it.

    Equals ``F.cross_entropy(F.linear(hidden, full_weight)[:, :vocab_size].float(), target,
    ignore_index=, label_smoothing=, reduction=)`` where ``full_weight`` concatenates the
    TP shards in rank order; "mean" divides by the number of non-ignored tokens of this
    call (combine across DP/CP with ``masked_mean``); over only ignored tokens it is nan
    with zero gradients, like torch. Returns fp32 (scalar, or ``[N]`` for "none").
    ``target [N]``: any integer dtype. ``chunk_size=None``: about
    ``DEFAULT_CHUNK_ELEMENTS`` logits per chunk. Not twice differentiable; with "mean" /
    "sum" one backward per call (gradients are made in forward).
    """
    reduction = check_reduction(reduction)
    ignore_index, eps = check_loss_args(ignore_index, label_smoothing)
    return _fused_loss(
        hidden,
        weight,
        target,
        lambda vocab: LossSpec.cross_entropy(vocab, ignore_index, eps),
        tp_group=tp_group,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        invariant=invariant,
        reduction=reduction,
    )


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """``log_softmax(hidden @ full_weight[:vocab_size].T / temperature)[target]`` ``[N]`` fp32.

    Every target must be in ``[0, vocab_size)``. Gradients recompute logits in backward.
    """
    temp = check_temperature(temperature)
    return _fused_loss(
        hidden,
        weight,
        target,
        lambda vocab: LossSpec.logprob(vocab, temp),
        tp_group=tp_group,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        invariant=invariant,
        reduction="none",
    )
