"""Cross-entropy, selected-token log-probs and entropy over vocab-parallel logits.

Layout: ``logits`` is ``[..., V_local]``, this TP rank's contiguous ``VocabShard`` of the
padded vocab (see ``vocab_shard_ranges``); ``target`` is ``[...]`` and identical on every
TP rank. Ids ``>= vocab_size`` are padding: they never enter a softmax, and results do
not depend on how much padding a TP size needed. Math (per token, over the true global
vocab of ``C = vocab_size`` classes, in fp32 whatever the input dtype):

- cross-entropy: ``(1 - eps) * (lse - z_t) + eps * (lse - mean_c z_c)``, which is
  ``F.cross_entropy(..., reduction="none", label_smoothing=eps)``; with per-class weights
  ``ce_weight=w`` ``(1 - eps) w_t (lse - z_t) + eps / C sum_c w_c (lse - z_c)``, torch's
  ``weight=`` (``class_weights``);
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
(``materialized.DefaultLoss``, ``reduce``). ``invariant=True``
(``materialized.InvariantLoss``): bitwise identical for every TP size whose shard is a whole
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
from mp_bridge.layers.loss.materialized import DefaultLoss, InvariantLoss
from mp_bridge.layers.loss.options import LossOptions, parse_loss_options
from mp_bridge.layers.loss.outputs import TokenOutputs

__all__ = [
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
]


def _run(where: str, logits: torch.Tensor, options: LossOptions):
    """The parsed call, agreed over TP, on the default (``DefaultLoss``) or TP-invariant
    (``InvariantLoss``) Function; its returned outputs. No target (entropy): ids -1, which
    own no column."""
    options.agree(where, device=logits.device)
    target = options.target
    if target is None:
        target = torch.full(logits.shape[:-1], -1, dtype=torch.long, device=logits.device)
    temp = options.token_temperature
    if options.invariant:
        layout = BlockLayout.of_shard(options.shard)
        logits = pad_single_shard(logits, -1, layout)
        out = InvariantLoss.apply(logits, target, options.tp_group, layout, options.spec, temp)
    else:
        group, shard, spec = options.tp_group, options.shard, options.spec
        out = DefaultLoss.apply(logits, target, group, shard, spec, temp)
    return options.returned(TokenOutputs(*out))


@agreed("mp_bridge.layers.vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    ce_weight: torch.Tensor | None = None,
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
    MAX then one batched all-reduce SUM over ``tp_group`` (fwd only). ``invariant=True``:
    bitwise TP-invariant, one forward all-gather (module docstring). ``ce_weight``: per-class
    weights ``[vocab_size]`` (full vocab, identical on every TP rank, floating, >= 0, no
    gradient), exactly ``F.cross_entropy(weight=ce_weight)``: with ``label_smoothing=eps``
    the per-token loss is ``(1 - eps) w_t (lse - z_t) + eps / V sum_c w_c (lse - z_c)`` and
    "mean" divides it by the sum of the counted targets' weights ``w_t``; with temperature and
    soft-cap the weight multiplies each token's cross-entropy term of ``z``; the z-loss is
    not weighted ("mean" divides it by the number of counted tokens, as Liger-Kernel).
    """
    options = parse_loss_options(
        "ce", logits=logits, target=target, tp_group=tp_group, vocab_size=vocab_size,
        ignore_index=ignore_index, label_smoothing=label_smoothing, ce_weight=ce_weight,
        invariant=invariant, temperature=temperature, softcap=softcap,
        z_loss_weight=z_loss_weight, return_z_loss=return_z_loss, reduction=reduction,
    )  # fmt: skip
    return _run("vocab_parallel_cross_entropy", logits, options)


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
    ``invariant=True``: bitwise TP-invariant, one forward all-gather.
    """
    options = parse_loss_options(
        "logprob", logits=logits, target=target, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, invariant=invariant, ignore_index=ignore_index,
        softcap=softcap, return_entropy=return_entropy,
        return_sum_pi_squared=return_sum_pi_squared, reduction=reduction,
    )  # fmt: skip
    return _run("vocab_parallel_logprobs", logits, options)


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
    ``invariant=True``: the entropy of ``vocab_parallel_logprobs(..., invariant=True,
    return_entropy=True)`` (one all-gather, bitwise TP-invariant).
    """
    options = parse_loss_options(
        "entropy", logits=logits, target=target, tp_group=tp_group, vocab_size=vocab_size,
        temperature=temperature, softcap=softcap, ignore_index=ignore_index,
        invariant=invariant, reduction=reduction,
    )  # fmt: skip
    return _run("vocab_parallel_entropy", logits, options)
