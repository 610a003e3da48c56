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

Options (``loss_math.LossSpec``): ``z = softcap(logits) / temperature`` with ``softcap(x)
= c tanh(x / c)``; the cross-entropy's ``z_loss_weight * lse**2`` (``return_z_loss``);
``ignore_index`` on log-probs; ``return_entropy`` on log-probs (the entropy of the same
distribution from the same pass). ``-inf`` logits (vocabulary masks, whole blocks or
shards) give finite values and gradients in every mode.

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

from mp_bridge.layers.loss.blocks import BlockLayout, pad_single_shard
from mp_bridge.layers.loss.checks import (
    check_bool,
    check_logits,
    check_loss_args,
    check_options,
    check_shard,
    check_target,
    check_temperature,
    check_tp_agreement,
)
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.materialized import InvariantLoss, ShardLoss

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
    temperature: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Equals ``F.cross_entropy(z.flatten(0, -2), target.flatten(), ignore_index=...,
    label_smoothing=..., reduction="none")`` reshaped to ``target.shape``, with ``z =
    softcap(full_logits[..., :vocab_size].float()) / temperature`` (``softcap(x) = c
    tanh(x / c)``, none by default), where ``full_logits`` concatenates the TP shards in
    rank order, plus ``z_loss_weight * logsumexp(z)**2`` per counted token (exactly
    nothing when 0). ``return_z_loss=True`` returns ``(loss, z_loss)``, the per-token
    z-loss part (no gradient; for logging). ``vocab_size=None`` means every row of the
    padded vocab is real. ``target`` must be identical on all TP ranks, with ids in ``[0,
    vocab_size)`` or ``ignore_index``. Collectives: all-reduce MAX then one batched
    all-reduce SUM over ``tp_group`` (fwd only). ``invariant=True`` delegates to
    ``invariant_cross_entropy`` (bitwise TP-invariant).
    """
    shard = check_logits(logits, tp_group, vocab_size)
    ignore_index, eps = check_loss_args(ignore_index, label_smoothing)
    temperature = check_temperature(temperature)
    softcap, zw, _ = check_options(
        softcap=softcap, z_loss_weight=z_loss_weight, flags={"return_z_loss": return_z_loss}
    )
    target = _check_target(target, logits, shard.vocab_size, ignore_index)
    options = {"temperature": temperature, "softcap": softcap, "z_loss_weight": zw}
    if check_bool("invariant", invariant):
        return invariant_cross_entropy(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            label_smoothing=eps,
            return_z_loss=return_z_loss,
            **options,
        )
    spec = LossSpec.cross_entropy(shard.vocab_size, ignore_index, eps, **options)
    _agree("vocab_parallel_cross_entropy", logits, target, tp_group, spec)
    loss, z_loss = ShardLoss.apply(logits, target, tp_group, shard, spec)
    return _with_z_loss(loss, z_loss, return_z_loss)


def _with_z_loss(loss, z_loss, return_z_loss: bool):
    if not return_z_loss:
        return loss
    return loss, z_loss.view(loss.shape) if z_loss.numel() else torch.zeros_like(loss.detach())


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    invariant: bool = False,
    ignore_index: int | None = None,
    softcap: float | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities ``[...]`` (fp32) of the ``target`` ids under ``softmax(z)``.

    ``z = softcap(full_logits[..., :vocab_size].float()) / temperature`` (``softcap(x) =
    c tanh(x / c)``, none by default); equals ``log_softmax(z, -1).gather(-1, target)``.
    Every target must be in ``[0, vocab_size)``, except where it equals ``ignore_index``
    (any int; ``None``: none), which gives log-prob 0 and gradient 0.
    ``return_entropy=True`` returns ``(logprobs, entropy)``, the entropy of the same
    ``softmax(z)`` per token (0 at ``ignore_index``), from the same pass over the vocab
    (one wider stats exchange) with gradients through both. Same two forward collectives
    as the cross-entropy, none backward; the gradient w.r.t. the local logits is ``g *
    (onehot - softmax) / T`` (times the soft-cap derivative). ``invariant=True``
    delegates to ``invariant_logprobs``.
    """
    shard = check_logits(logits, tp_group, vocab_size)
    temperature = check_temperature(temperature)
    softcap, _, ignore_index = check_options(
        softcap=softcap, ignore_index=ignore_index, flags={"return_entropy": return_entropy}
    )
    target = _check_target(target, logits, shard.vocab_size, ignore_index)
    if check_bool("invariant", invariant):
        return invariant_logprobs(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            temperature=temperature,
            ignore_index=ignore_index,
            softcap=softcap,
            return_entropy=return_entropy,
        )
    spec = LossSpec.logprob(
        shard.vocab_size,
        temperature,
        ignore_index=ignore_index,
        softcap=softcap,
        entropy=return_entropy,
    )
    _agree("vocab_parallel_logprobs", logits, target, tp_group, spec)
    lp, entropy = ShardLoss.apply(logits, target, tp_group, shard, spec)
    return (lp, entropy) if return_entropy else lp


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    softcap: float | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Per-token entropy ``[...]`` (fp32) of ``softmax(softcap(full_logits[...,
    :vocab_size]))``.

    Two forward collectives over ``tp_group`` (MAX, then a batched SUM), none backward.
    ``invariant=True``: the entropy of ``invariant_logprobs(..., return_entropy=True)``
    (one all-gather, bitwise TP-invariant).
    """
    shard = check_logits(logits, tp_group, vocab_size)
    softcap, _, _ = check_options(softcap=softcap, flags={"invariant": invariant})
    # The entropy output of log-probs with no target (-1: in no shard).
    no_target = torch.full(logits.shape[:-1], -1, dtype=torch.long, device=logits.device)
    spec_of = lambda vocab: LossSpec.logprob(vocab, 1.0, softcap=softcap, entropy=True)  # noqa: E731
    if not invariant:
        spec = spec_of(shard.vocab_size)
        _agree("vocab_parallel_entropy", logits, None, tp_group, spec)
        return ShardLoss.apply(logits, no_target, tp_group, shard, spec)[1]
    return _invariant(logits, no_target, tp_group, vocab_size, spec_of)[1]


def _invariant(logits, target, tp_group, vocab_size, spec_of):
    """``(value, extra)`` of ``InvariantLoss`` (``extra``: see ``ShardLoss``)."""
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
    temperature: float = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Same semantics and options as ``vocab_parallel_cross_entropy`` (ignored tokens: 0 and
    grad 0; smoothing over the true vocab); bitwise identical across block-aligned TP
    sizes and batch compositions. ``target`` and the options are validated by the caller.
    """
    loss, z_loss = _invariant(
        logits,
        target,
        tp_group,
        vocab_size,
        lambda vocab: LossSpec.cross_entropy(
            vocab,
            ignore_index,
            label_smoothing,
            temperature=temperature,
            softcap=softcap,
            z_loss_weight=z_loss_weight,
        ),
    )
    return _with_z_loss(loss, z_loss, return_z_loss)


def invariant_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    temperature: float,
    ignore_index: int | None = None,
    softcap: float | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(softcap(logits) / temperature)[target]`` ``[...]`` (fp32), bitwise
    TP-invariant; options as ``vocab_parallel_logprobs``."""
    lp, entropy = _invariant(
        logits,
        target,
        tp_group,
        vocab_size,
        lambda vocab: LossSpec.logprob(
            vocab, temperature, ignore_index=ignore_index, softcap=softcap, entropy=return_entropy
        ),
    )
    return (lp, entropy) if return_entropy else lp
