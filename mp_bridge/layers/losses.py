"""Cross-entropy, selected-token log-probs and entropy over vocab-parallel logits.

Layout: ``logits`` is ``[..., V_local]``, this TP rank's contiguous ``VocabShard`` of the
padded vocab (see ``vocab_shard_ranges``); ``target`` is ``[...]`` and identical on every
TP rank. Ids ``>= vocab_size`` are padding: they never enter a softmax, and results do
not depend on how much padding a TP size needed. Math (per token, over the true global
vocab of ``C = vocab_size`` classes, in fp32 whatever the input dtype):

- cross-entropy: ``(1 - eps) * (lse - z_t) + eps * (lse - mean_c z_c)``, which is
  ``F.cross_entropy(..., reduction="none", label_smoothing=eps)``; ``target ==
  ignore_index`` gives loss 0 and gradient 0.
- log-probs: ``log_softmax(z / T)[t]``.
- entropy: ``-sum_c p_c log p_c``; gradient ``-p_j (log p_j + H)``.

Default mode: two forward collectives (MAX, then one batched SUM), none in backward
(``materialized``, ``loss_reduce``). ``invariant=True`` (``invariant_cross_entropy`` /
``invariant_logprobs``): bitwise identical for every TP size whose shard is a whole
number of ``VOCAB_BLOCK`` rows (``loss_blocks``), and for any batch composition; one
forward all-gather, none in backward.

Inputs are never modified; outputs are fp32 ``[...]`` (fp64 for fp64 logits in default
mode); input gradients have the logits' dtype. Targets may have any integer dtype and are
validated (one host sync) before any collective. The ops are differentiable once:
``backward(create_graph=True)`` raises (the backward reuses saved global statistics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .loss_blocks import BlockLayout, pad_single_shard
from .loss_checks import (
    check_bool,
    check_logits,
    check_loss_args,
    check_shard,
    check_target,
    check_temperature,
    check_tp_agreement,
)
from .loss_math import LossSpec
from .materialized import DefaultCrossEntropy, DefaultEntropy, InvariantLoss

__all__ = [
    "invariant_cross_entropy",
    "invariant_logprobs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]


def _agree(where: str, logits, target, tp_group, spec) -> None:
    """One agreement check over TP (``MP_BRIDGE_CHECK``): shapes, dtype, spec, target bits."""
    check_tp_agreement(where, tp_group, {"logits": logits}, {"spec": spec}, {"target": target})


def _check_target(target: object, logits: torch.Tensor, vocab: int, ignore_index) -> torch.Tensor:
    return check_target(
        target,
        tuple(logits.shape[:-1]),
        vocab,
        ignore_index,
        shape_of=f"logits shape {tuple(logits.shape)} without the vocab dim ",
    )


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
    only). ``invariant=True`` delegates to ``invariant_cross_entropy`` (bitwise
    TP-invariant).
    """
    shard = check_logits(logits, tp_group, vocab_size)
    ignore_index, eps = check_loss_args(ignore_index, label_smoothing)
    target = _check_target(target, logits, shard.vocab_size, ignore_index)
    if check_bool("invariant", invariant):
        return invariant_cross_entropy(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            label_smoothing=eps,
        )
    spec = LossSpec.cross_entropy(shard.vocab_size, ignore_index, eps)
    _agree("vocab_parallel_cross_entropy", logits, target, tp_group, spec)
    return DefaultCrossEntropy.apply(logits, target, tp_group, shard, spec, 1.0)


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
    ``invariant_logprobs``.
    """
    shard = check_logits(logits, tp_group, vocab_size)
    temperature = check_temperature(temperature)
    target = _check_target(target, logits, shard.vocab_size, None)
    if check_bool("invariant", invariant):
        return invariant_logprobs(
            logits, target, tp_group=tp_group, vocab_size=vocab_size, temperature=temperature
        )
    # log-prob = -nll of logits / T (the cross-entropy without smoothing, scaled by 1 / T).
    spec = LossSpec.cross_entropy(shard.vocab_size, None, 0.0)
    _agree("vocab_parallel_logprobs", logits, target, tp_group, (spec, temperature))
    return -DefaultCrossEntropy.apply(logits, target, tp_group, shard, spec, 1.0 / temperature)


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token entropy ``[...]`` (fp32) of ``softmax(full_logits[..., :vocab_size])``.

    Two forward collectives over ``tp_group`` (MAX, then a batched SUM), none backward.
    """
    shard = check_logits(logits, tp_group, vocab_size)
    _agree("vocab_parallel_entropy", logits, None, tp_group, shard.vocab_size)
    return DefaultEntropy.apply(logits, tp_group, shard)


def _invariant(logits, target, tp_group, vocab_size, spec_of) -> torch.Tensor:
    layout = BlockLayout.of_shard(check_shard(logits.shape[-1], vocab_size, tp_group))
    spec = spec_of(layout.vocab_size)
    _agree("invariant loss", logits, target, tp_group, spec)
    logits = pad_single_shard(logits, -1, layout)
    return InvariantLoss.apply(logits, target, tp_group, layout, spec)


def invariant_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Same semantics as ``vocab_parallel_cross_entropy`` (ignored tokens: 0 and grad 0;
    smoothing over the true vocab); bitwise identical across block-aligned TP sizes and
    batch compositions. ``target`` is validated by the caller.
    """
    return _invariant(
        logits,
        target,
        tp_group,
        vocab_size,
        lambda vocab: LossSpec.cross_entropy(vocab, ignore_index, label_smoothing),
    )


def invariant_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    temperature: float,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[target]`` ``[...]`` (fp32), bitwise TP-invariant."""
    return _invariant(
        logits, target, tp_group, vocab_size, lambda vocab: LossSpec.logprob(vocab, temperature)
    )
