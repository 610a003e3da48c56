"""Cross-entropy, selected-token log-probs and entropy over vocab-parallel logits.

Layout: ``logits`` is ``[..., V_local]``, this TP rank's contiguous slice of the padded
vocab (rank r holds ids ``[r * V_local, (r + 1) * V_local)``, see ``vocab_shard_ranges``);
``target`` is ``[...]`` and identical on every TP rank. Ids ``>= vocab_size`` are padding:
their logits are masked to ``-inf`` so they never enter a softmax, and results do not
depend on how much padding a TP size needed.

Math (per token, over the true global vocab of ``C = vocab_size`` classes, in fp32 whatever
the input dtype): ``m = max_c z_c`` (all-reduce MAX), then one batched all-reduce SUM of
``[sum_c exp(z_c - m), z_t - m, sum_c (z_c - m)]`` (the entropy variant sums
``exp(z_c - m) * (z_c - m)`` instead). So every call issues exactly two collectives in
forward and none in backward: the gradient of each rank's slice needs only the per-token
global statistics, which are saved.

- cross-entropy: ``(1 - eps) * (lse - z_t) + eps * (lse - mean_c z_c)``, which is
  ``F.cross_entropy(..., reduction="none", label_smoothing=eps)``; ``target ==
  ignore_index`` gives loss 0 and gradient 0.
- log-probs: ``log_softmax(z / T)[t]``.
- entropy: ``-sum_c p_c log p_c``; gradient ``-p_j (log p_j + H)``.

Inputs are never modified; outputs are fp32 ``[...]`` (fp64 for fp64 logits, which also
compute in fp64); input gradients have the logits' dtype. Targets may have any integer
dtype (int32 / uint8 ids are used as int64) and are validated (one host sync) before any
collective. The ops are differentiable once: ``backward(create_graph=True)`` raises,
because the backward reuses the saved global statistics as constants.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm.primitives import group_rank, group_size

from ._loss_common import (
    check_loss_args,
    check_target,
    check_temperature,
    check_vocab_size,
    forbid_double_backward,
)

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_entropy", "vocab_parallel_logprobs"]


# ------------------------------------------------------------------ validation
def _check_logits(logits: object, tp_group, vocab_size: object) -> int:
    """Validate ``logits [..., V_local]`` and ``vocab_size``; return the true global vocab."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got dtype={logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must be [..., V_local] with V_local >= 1, got {tuple(logits.shape)}"
        )
    tp = group_size(tp_group)
    return check_vocab_size(vocab_size, logits.shape[-1] * tp, logits.shape[-1], tp)


def _check_target(target: object, logits: torch.Tensor, vocab: int, ignore_index) -> torch.Tensor:
    return check_target(
        target,
        tuple(logits.shape[:-1]),
        vocab,
        ignore_index,
        shape_of=f"logits shape {tuple(logits.shape)} without the vocab dim ",
    )


def _shard_start(logits: torch.Tensor, tp_group) -> int:
    return group_rank(tp_group) * logits.shape[-1]


def _masked_fp32(logits: torch.Tensor, start: int, vocab_size: int, scale: float) -> torch.Tensor:
    """fp32 (fp64 for fp64) local logits (times ``scale``) with padding columns at ``-inf``."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc) * scale if scale != 1.0 else logits.to(acc)
    valid = vocab_size - start  # columns [valid, V_local) of this shard are padding
    if valid < x.shape[-1]:
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # fp32 input: never write into the caller's tensor
        x[..., max(valid, 0) :] = float("-inf")
    return x


def _global_max(x: torch.Tensor, tp_group) -> torch.Tensor:
    m = x.detach().amax(dim=-1)
    if group_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    return m


def _sum_over_group(stats: torch.Tensor, tp_group) -> torch.Tensor:
    if group_size(tp_group) > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)
    return stats


def _local_target(target: torch.Tensor, start: int, v_local: int):
    """Local column of each target and whether this rank owns it."""
    owned = (target >= start) & (target < start + v_local)
    col = torch.where(owned, target - start, torch.zeros_like(target))
    return col, owned


# ------------------------------------------------------------------ autograd
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``(1-eps) * nll + eps * smooth`` of ``scale * logits``; ignored tokens 0.

    Forward: all-reduce MAX [tokens] + all-reduce SUM [tokens, 2 or 3] over ``tp_group``.
    Backward (no collective): ``g * scale * (softmax - (1-eps) onehot - eps/C)`` on valid
    columns, 0 on padding columns and ignored tokens.
    """

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size, ignore_index, eps, scale):
        start = _shard_start(logits, tp_group)
        x = _masked_fp32(logits, start, vocab_size, scale)
        m = _global_max(x, tp_group)
        x = x - m.unsqueeze(-1)
        col, owned = _local_target(target, start, x.shape[-1])
        picked = torch.where(owned, x.gather(-1, col.unsqueeze(-1)).squeeze(-1), 0.0)
        parts = [x.exp().sum(-1), picked]
        if eps > 0:
            # Sum of the shifted logits over this shard's *valid* columns (-inf -> 0).
            parts.append(torch.where(torch.isinf(x), 0.0, x).sum(-1))
        stats = _sum_over_group(torch.stack(parts, dim=-1), tp_group)
        lse = stats[..., 0].log()
        loss = lse - stats[..., 1]
        if eps > 0:
            loss = (1.0 - eps) * loss + eps * (lse - stats[..., 2] / vocab_size)
        ignored = target == ignore_index if ignore_index is not None else None
        if ignored is not None:
            loss = torch.where(ignored, 0.0, loss)
        ctx.save_for_backward(logits, col, owned, m + lse, ignored)
        ctx.args = (start, vocab_size, eps, scale)
        ctx.has_ignored = ignored is not None
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        forbid_double_backward("vocab_parallel_cross_entropy / vocab_parallel_logprobs")
        logits, col, owned, shift, ignored = ctx.saved_tensors
        start, vocab_size, eps, scale = ctx.args
        x = _masked_fp32(logits, start, vocab_size, scale)
        grad = (x - shift.unsqueeze(-1)).exp()  # softmax; padding columns exp(-inf) = 0
        one = torch.where(owned, 1.0 - eps, 0.0).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, col.unsqueeze(-1), -one)
        if eps > 0:
            valid = max(min(vocab_size - start, grad.shape[-1]), 0)
            grad[..., :valid] -= eps / vocab_size
        g = grad_loss.to(grad.dtype)
        if ctx.has_ignored:
            g = torch.where(ignored, 0.0, g)
        grad.mul_((g * scale).unsqueeze(-1))
        return grad.to(logits.dtype), None, None, None, None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Per-token entropy of ``softmax(logits)`` over the true vocab.

    Forward: all-reduce MAX [tokens] + all-reduce SUM [tokens, 2]. Backward (no
    collective): ``-g * p_j * (log p_j + H)``; 0 on padding columns.
    """

    @staticmethod
    def forward(ctx, logits, tp_group, vocab_size):
        start = _shard_start(logits, tp_group)
        x = _masked_fp32(logits, start, vocab_size, 1.0)
        m = _global_max(x, tp_group)
        x = x - m.unsqueeze(-1)
        e = x.exp()
        ex = torch.where(e > 0, e * x, 0.0)  # exp(-inf) * -inf would be nan
        stats = _sum_over_group(torch.stack([e.sum(-1), ex.sum(-1)], dim=-1), tp_group)
        lse = stats[..., 0].log()
        entropy = lse - stats[..., 1] / stats[..., 0]
        ctx.save_for_backward(logits, m + lse, entropy)
        ctx.args = (start, vocab_size)
        return entropy

    @staticmethod
    def backward(ctx, grad_h):
        forbid_double_backward("vocab_parallel_entropy")
        logits, shift, entropy = ctx.saved_tensors
        start, vocab_size = ctx.args
        x = _masked_fp32(logits, start, vocab_size, 1.0)
        logp = x - shift.unsqueeze(-1)
        p = logp.exp()
        grad = torch.where(p > 0, p * (logp + entropy.unsqueeze(-1)), 0.0)
        grad.mul_(-grad_h.to(grad.dtype).unsqueeze(-1))
        return grad.to(logits.dtype), None, None


# ------------------------------------------------------------------ public API
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    invariant: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Equals ``F.cross_entropy(full_logits[..., :vocab_size].float().flatten(0, -2),
    target.flatten(), ignore_index=..., label_smoothing=..., reduction="none")`` reshaped
    to ``target.shape``, where ``full_logits`` concatenates the TP shards in rank order.
    ``vocab_size=None`` means every row of the padded vocab is real. ``target`` must be
    identical on all TP ranks, with ids in ``[0, vocab_size)`` or ``ignore_index``.
    Collectives: all-reduce MAX then one batched all-reduce SUM over ``tp_group`` (fwd
    only). ``invariant=True`` delegates to
    ``mp_bridge.layers.invariant.invariant_cross_entropy`` (bitwise TP-invariant).
    """
    vocab = _check_logits(logits, tp_group, vocab_size)
    ignore_index, eps = check_loss_args(ignore_index, label_smoothing)
    target = _check_target(target, logits, vocab, ignore_index)
    if invariant:
        from mp_bridge.layers.invariant import invariant_cross_entropy

        return invariant_cross_entropy(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            label_smoothing=eps,
        )
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab, ignore_index, eps, 1.0)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    invariant: bool = False,
) -> torch.Tensor:
    """Log-probabilities ``[...]`` (fp32) of the ``target`` ids under ``softmax(logits / T)``.

    Equals ``log_softmax(full_logits[..., :vocab_size].float() / T, -1).gather(-1, target)``.
    Every target must be in ``[0, vocab_size)`` (mask unwanted tokens afterwards). Same
    two forward collectives as the cross-entropy, none backward; the gradient w.r.t. the
    local logits is ``g * (onehot - softmax) / T``. ``invariant=True`` delegates to
    ``mp_bridge.layers.invariant.invariant_logprobs``.
    """
    vocab = _check_logits(logits, tp_group, vocab_size)
    temperature = check_temperature(temperature)
    target = _check_target(target, logits, vocab, None)
    if invariant:
        from mp_bridge.layers.invariant import invariant_logprobs

        return invariant_logprobs(
            logits, target, tp_group=tp_group, vocab_size=vocab_size, temperature=temperature
        )
    nll = _VocabParallelCrossEntropy.apply(
        logits, target, tp_group, vocab, None, 0.0, 1.0 / temperature
    )
    return -nll


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token entropy ``[...]`` (fp32) of ``softmax(full_logits[..., :vocab_size])``.

    Two forward collectives over ``tp_group`` (MAX, then a batched SUM), none backward.
    """
    vocab = _check_logits(logits, tp_group, vocab_size)
    return _VocabParallelEntropy.apply(logits, tp_group, vocab)
