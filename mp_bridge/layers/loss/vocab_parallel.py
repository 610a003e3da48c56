"""Cross-entropy, selected-token log-probs and entropy over vocab-parallel logits.

Layout: ``logits`` is ``[..., V_local]``, this TP rank's contiguous ``VocabShard`` of the
padded vocab (see ``vocab_shard_ranges``); ``target`` is ``[...]`` and identical on every
TP rank. Ids ``>= vocab_size`` are padding: they never enter a softmax, and results do
not depend on how much padding a TP size needed. Math (per token, over the true global
vocab of ``C = vocab_size`` classes, in fp32 whatever the input dtype):

- cross-entropy: ``(1 - eps) * (lse - z_t) + eps * (lse - mean_c z_c)``, which is
  ``F.cross_entropy(..., reduction="none", label_smoothing=eps)``;
- log-probs: ``log_softmax(z)[t]``;
- entropy: ``-sum_c p_c log p_c``; gradient ``-p_j (log p_j + H)``.

Options, the same name and default on every loss API where they mean the same thing
(``formulas.LossSpec``): ``z = softcap(logits) / temperature`` with ``softcap(x) = c
tanh(x / c)``; ``temperature`` a float or a tensor broadcastable to the tokens' shape
(per token or per sample; identical on every TP rank; no gradient flows to it);
``ignore_index`` (default -100, ``None``: none; on the entropy it needs ``target``) gives
0 and gradient 0 on every output; ``reduction`` ("none" by default here, "sum", "mean"
over counted tokens; ``outputs``); the cross-entropy's ``z_loss_weight * lse**2``
(``return_z_loss``); on log-probs ``return_entropy`` and ``return_sum_pi_squared``
(``sum_c p_c**2``, no gradient), both of the same distribution from the same pass, in
the order logprobs, entropy, sum_pi_squared. ``-inf`` logits (vocabulary masks, whole
blocks or shards) give finite values and gradients in every mode.

``invariant=False``: two forward collectives (MAX, then one batched SUM), none in backward
(``materialized``, ``reduce``). ``invariant=True`` (``invariant_cross_entropy`` /
``invariant_logprobs``): bitwise identical for every TP size whose shard is a whole
number of ``VOCAB_BLOCK`` rows (``blocks``), and for any batch composition; one forward
all-gather, none in backward.

Inputs are never modified; outputs are fp32 ``[...]`` (fp64 for fp64 logits with
``invariant=False``); input gradients have the logits' dtype. Targets may have any integer
dtype and are validated (one host sync; a temperature tensor likewise) before any
collective. The ops are differentiable once: ``backward(create_graph=True)`` raises (the
backward reuses saved global statistics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import agreed
from mp_bridge.layers.loss.blocks import BlockLayout, pad_single_shard
from mp_bridge.layers.loss.checks import (
    check_ignore_index,
    check_logits,
    check_loss_args,
    check_options,
    check_reduction,
    check_shard,
    check_target,
    check_temperature,
    check_tp_agreement,
)
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.materialized import InvariantLoss, ShardLoss
from mp_bridge.layers.loss.outputs import counted_tokens, returned

__all__ = [
    "invariant_cross_entropy",
    "invariant_logprobs",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]


def _tokens(logits: torch.Tensor) -> str:
    return f"logits shape {tuple(logits.shape)} without the vocab dim "


def _check_target(target: object, logits: torch.Tensor, vocab: int, ignore_index) -> torch.Tensor:
    shape = tuple(logits.shape[:-1])
    return check_target(target, shape, vocab, ignore_index, shape_of=_tokens(logits))


def _temperature(temperature, logits: torch.Tensor):
    """``(float, tensor or None)``: the spec's float and the per-token tensor (then 1.0)."""
    temp = check_temperature(
        temperature, tuple(logits.shape[:-1]), logits, shape_of=_tokens(logits)
    )
    return (1.0, temp) if isinstance(temp, torch.Tensor) else (temp, None)


def _agree(where: str, logits, target, tp_group, spec, token_temperature) -> None:
    """One agreement check over TP (``MP_BRIDGE_CHECK``): shapes, dtype, spec, and the
    bits of the target and the per-token temperature."""
    identical = {"target": target, "temperature": token_temperature}
    check_tp_agreement(where, tp_group, {"logits": logits}, {"spec": spec}, identical)


def _rows_of(token_temperature, dtype: torch.dtype) -> torch.Tensor | None:
    """The per-token temperature of ``ShardLoss``: flat ``[N]`` in the accumulation dtype
    of ``dtype`` logits (fp64 for fp64), or ``None``."""
    if token_temperature is None:
        return None
    return token_temperature.to(torch.promote_types(dtype, torch.float32)).reshape(-1)


@agreed("mp_bridge.layers.vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    invariant: bool = False,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
    reduction: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Equals ``F.cross_entropy(z.flatten(0, -2), target.flatten(), ignore_index=...,
    label_smoothing=..., reduction="none")`` reshaped to ``target.shape``, with ``z =
    softcap(full_logits[..., :vocab_size].float()) / temperature`` (``softcap(x) = c
    tanh(x / c)``, none by default), where ``full_logits`` concatenates the TP shards in
    rank order, plus ``z_loss_weight * logsumexp(z)**2`` per counted token (exactly
    nothing when 0). ``temperature``: a float or a tensor broadcastable to
    ``target.shape`` (per token or per sample), identical on every TP rank, no gradient.
    ``return_z_loss=True`` returns ``(loss, z_loss)``, the per-token z-loss part (no
    gradient; for logging). ``reduction``: "none" (default, per token), "sum" or "mean"
    (over tokens not at ``ignore_index``), applied to both outputs. ``vocab_size=None``
    means every row of the padded vocab is real. ``target`` must be identical on all TP
    ranks, with ids in ``[0, vocab_size)`` or ``ignore_index``. Collectives: all-reduce
    MAX then one batched all-reduce SUM over ``tp_group`` (fwd only). ``invariant=True``
    delegates to ``invariant_cross_entropy`` (bitwise TP-invariant).
    """
    shard = check_logits(logits, tp_group, vocab_size)
    ignore_index, eps = check_loss_args(ignore_index, label_smoothing)
    flags = {"return_z_loss": return_z_loss, "invariant": invariant}
    softcap, zw, _ = check_options(softcap=softcap, z_loss_weight=z_loss_weight, flags=flags)
    reduction = check_reduction(reduction)
    target = _check_target(target, logits, shard.vocab_size, ignore_index)
    temp, token_temp = _temperature(temperature, logits)
    if invariant:
        return invariant_cross_entropy(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            label_smoothing=eps,
            return_z_loss=return_z_loss,
            temperature=temp if token_temp is None else token_temp,
            softcap=softcap,
            z_loss_weight=zw,
            reduction=reduction,
        )
    spec = LossSpec.cross_entropy(
        shard.vocab_size, ignore_index, eps, temperature=temp, softcap=softcap, z_loss_weight=zw
    )
    _agree("vocab_parallel_cross_entropy", logits, target, tp_group, spec, token_temp)
    temp_rows = _rows_of(token_temp, logits.dtype)
    loss, z_loss, _ = ShardLoss.apply(logits, target, tp_group, shard, spec, temp_rows)
    return _with_z_loss(
        loss, z_loss, return_z_loss, counted_tokens(target, ignore_index), reduction
    )


def _with_z_loss(loss, z_loss, return_z_loss: bool, counted, reduction: str):
    if return_z_loss:
        z_loss = z_loss.view(loss.shape) if z_loss.numel() else torch.zeros_like(loss.detach())
    return returned([loss, z_loss if return_z_loss else None], counted, reduction)


@agreed("mp_bridge.layers.vocab_parallel_logprobs")
def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    invariant: bool = False,
    ignore_index: int | None = -100,
    softcap: float | None = None,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
    reduction: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-probabilities ``[...]`` (fp32) of the ``target`` ids under ``softmax(z)``.

    ``z = softcap(full_logits[..., :vocab_size].float()) / temperature`` (``softcap(x) =
    c tanh(x / c)``, none by default; ``temperature`` a float or a tensor broadcastable to
    ``target.shape``, per token or per sample, identical on every TP rank, no gradient);
    equals ``log_softmax(z, -1).gather(-1, target)``. Every target must be in ``[0,
    vocab_size)``, except where it equals ``ignore_index`` (default -100, as on the
    cross-entropy; ``None``: none), which gives 0 on every output and gradient 0.
    ``return_entropy=True`` adds the entropy of the same ``softmax(z)`` per token (with
    gradient); ``return_sum_pi_squared=True`` adds ``sum_c softmax(z)_c**2`` per token
    (no gradient); outputs in the order ``(logprobs, entropy, sum_pi_squared)``, all from
    the same pass over the vocab (one wider stats exchange). ``reduction``: "none"
    (default), "sum" or "mean" over counted tokens, applied to every output. Same two
    forward collectives as the cross-entropy, none backward; the gradient w.r.t. the local
    logits is ``g * (onehot - softmax) / T`` (times the soft-cap derivative).
    ``invariant=True`` delegates to ``invariant_logprobs``.
    """
    shard = check_logits(logits, tp_group, vocab_size)
    flags = {
        "return_entropy": return_entropy,
        "return_sum_pi_squared": return_sum_pi_squared,
        "invariant": invariant,
    }
    softcap, _, ignore_index = check_options(
        softcap=softcap, ignore_index=ignore_index, flags=flags
    )
    reduction = check_reduction(reduction)
    target = _check_target(target, logits, shard.vocab_size, ignore_index)
    temp, token_temp = _temperature(temperature, logits)
    if invariant:
        return invariant_logprobs(
            logits,
            target,
            tp_group=tp_group,
            vocab_size=vocab_size,
            temperature=temp if token_temp is None else token_temp,
            ignore_index=ignore_index,
            softcap=softcap,
            return_entropy=return_entropy,
            return_sum_pi_squared=return_sum_pi_squared,
            reduction=reduction,
        )
    spec = LossSpec.logprob(
        shard.vocab_size,
        temp,
        ignore_index=ignore_index,
        softcap=softcap,
        entropy=return_entropy,
        sum_pi_squared=return_sum_pi_squared,
    )
    _agree("vocab_parallel_logprobs", logits, target, tp_group, spec, token_temp)
    temp_rows = _rows_of(token_temp, logits.dtype)
    lp, entropy, sq = ShardLoss.apply(logits, target, tp_group, shard, spec, temp_rows)
    outputs = [lp, entropy if return_entropy else None, sq if return_sum_pi_squared else None]
    return returned(outputs, counted_tokens(target, ignore_index), reduction)


@agreed("mp_bridge.layers.vocab_parallel_entropy")
def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int | None = -100,
    invariant: bool = False,
    reduction: str = "none",
) -> torch.Tensor:
    """Per-token entropy ``[...]`` (fp32) of ``softmax(softcap(full_logits[...,
    :vocab_size]) / temperature)``.

    ``target [...]`` (optional, identical on every TP rank) only marks the tokens whose
    id is ``ignore_index`` (default -100): entropy 0 and gradient 0 there, and not
    counted by ``reduction="mean"``; without it every token counts. ``temperature``: a
    float or a tensor broadcastable to ``logits.shape[:-1]`` (no gradient). Two forward
    collectives over ``tp_group`` (MAX, then a batched SUM), none backward.
    ``invariant=True``: the entropy of ``invariant_logprobs(..., return_entropy=True)``
    (one all-gather, bitwise TP-invariant).
    """
    shard = check_logits(logits, tp_group, vocab_size)
    softcap, _, ignore_index = check_options(
        softcap=softcap, ignore_index=ignore_index, flags={"invariant": invariant}
    )
    reduction = check_reduction(reduction)
    if target is not None:
        target = _check_target(target, logits, shard.vocab_size, ignore_index)
    temp, token_temp = _temperature(temperature, logits)
    counted = counted_tokens(target, ignore_index)
    # The entropy output of log-probs; no target: -1 owns no column, and no id is ignored.
    ignored_id = ignore_index
    if target is None:
        target = torch.full(logits.shape[:-1], -1, dtype=torch.long, device=logits.device)
        ignored_id = None
    spec_of = lambda vocab: LossSpec.logprob(  # noqa: E731
        vocab, temp, ignore_index=ignored_id, softcap=softcap, entropy=True
    )
    if not invariant:
        spec = spec_of(shard.vocab_size)
        _agree("vocab_parallel_entropy", logits, target, tp_group, spec, token_temp)
        temp_rows = _rows_of(token_temp, logits.dtype)
        entropy = ShardLoss.apply(logits, target, tp_group, shard, spec, temp_rows)[1]
        return returned([entropy], counted, reduction)
    entropy = _invariant(logits, target, tp_group, vocab_size, spec_of, token_temp)[1]
    return returned([entropy], counted, reduction)


def _invariant(logits, target, tp_group, vocab_size, spec_of, token_temperature=None):
    """``(value, extra, sq)`` of ``InvariantLoss`` (see ``ShardLoss``)."""
    layout = BlockLayout.of_shard(check_shard(logits.shape[-1], vocab_size, tp_group))
    spec = spec_of(layout.vocab_size)
    _agree("invariant loss", logits, target, tp_group, spec, token_temperature)
    logits = pad_single_shard(logits, -1, layout)
    temp = None
    if token_temperature is not None:
        temp = token_temperature.to(torch.float32).reshape(-1)
    return InvariantLoss.apply(logits, target, tp_group, layout, spec, temp)


def _split(temperature) -> tuple[float, torch.Tensor | None]:
    """A validated temperature as ``(float for the spec, per-token tensor or None)``."""
    if isinstance(temperature, torch.Tensor):
        return 1.0, temperature
    return float(temperature), None


def invariant_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    ignore_index: int | None,
    label_smoothing: float,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
    reduction: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Same semantics and options as ``vocab_parallel_cross_entropy`` (ignored tokens: 0 and
    grad 0; smoothing over the true vocab); bitwise identical across block-aligned TP
    sizes and batch compositions. ``target`` and the options are validated by the caller
    (a temperature tensor: already broadcast to ``target.shape``).
    """
    temp, token_temp = _split(temperature)
    loss, z_loss, _ = _invariant(
        logits,
        target,
        tp_group,
        vocab_size,
        lambda vocab: LossSpec.cross_entropy(
            vocab,
            ignore_index,
            label_smoothing,
            temperature=temp,
            softcap=softcap,
            z_loss_weight=z_loss_weight,
        ),
        token_temp,
    )
    return _with_z_loss(
        loss, z_loss, return_z_loss, counted_tokens(target, ignore_index), reduction
    )


def invariant_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    temperature: float | torch.Tensor,
    ignore_index: int | None = -100,
    softcap: float | None = None,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
    reduction: str = "none",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``log_softmax(softcap(logits) / temperature)[target]`` ``[...]`` (fp32), bitwise
    TP-invariant; options as ``vocab_parallel_logprobs`` (validated by the caller)."""
    temp, token_temp = _split(temperature)
    ignore_index = check_ignore_index(ignore_index)
    lp, entropy, sq = _invariant(
        logits,
        target,
        tp_group,
        vocab_size,
        lambda vocab: LossSpec.logprob(
            vocab,
            temp,
            ignore_index=ignore_index,
            softcap=softcap,
            entropy=return_entropy,
            sum_pi_squared=return_sum_pi_squared,
        ),
        token_temp,
    )
    outputs = [lp, entropy if return_entropy else None, sq if return_sum_pi_squared else None]
    return returned(outputs, counted_tokens(target, ignore_index), reduction)
