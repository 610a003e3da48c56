"""Fused LM-head cross-entropy / log-probs: hidden states + vocab shard -> loss, no logits.

``hidden [N, H]`` is TP-replicated (identical on every rank of ``tp_group``), ``weight
[V_local, H]`` is this rank's ``VocabShard`` of the padded vocab (ids ``>= vocab_size``
are padding and never enter a softmax: the layout of ``VocabParallelLMHead`` or a tied
``VocabParallelEmbedding``), ``target [N]``. Options (``LossSpec``; the same names and
defaults as ``vocab_parallel``): temperature (a float, or a tensor per token / per
sample), soft-cap, z-loss, ``ignore_index`` (default -100), ``reduction``, on the
cross-entropy per-class weights ``ce_weight`` (``class_weights``; both engines), and on
log-probs the entropy and ``sum_pi_squared`` of the same distribution from the same pass.
Outputs are fp32; statistics and gradients accumulate in fp32 whatever the input dtype.

Each door parses its arguments into one ``LossOptions`` (``options``), which names the
engine (``engine="auto" | "torch" | "triton"``, chosen by ``engines.protocol.choose_engine``:
``"auto"`` is ``"triton"`` for CUDA tensors it can run, else ``"torch"``; an explicit
engine never falls back, an input it cannot run is a ``ValueError``), lets the TP ranks
agree on it, and hands the flattened tokens to the engine (``engines/protocol.py``): the
``"torch"`` engine (``engines/torch_ops``: chunked matmuls, gradients in forward for
"sum" / "mean", recomputed in backward otherwise; its collectives, memory and
invariant-mode guarantees are in its docstring) or the ``"triton"`` GPU engine
(``engines/triton_ops``, imported only when asked for or picked). Per-token outputs come
back as one ``outputs.TokenOutputs``.

A ``DTensor`` weight is vocab-parallel only where declared (``Shard(0)`` over the mesh dim
``"tp"`` or ``vocab_mesh_dim=``; the TP group from the mesh, uneven and empty shards as
``distribute_tensor`` makes them, the gradient a ``DTensor`` of the weight's placements);
any other is refused by name, and a ``DTensor`` ``hidden`` is redistributed to replicated
tokens (one all-gather): ``dtensor_weight``, the first step of each door.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import agreed
from mp_bridge.layers.loss.dtensor_weight import local_operands
from mp_bridge.layers.loss.engines.protocol import choose_engine, load_engine
from mp_bridge.layers.loss.options import LossOptions, parse_loss_options
from mp_bridge.layers.loss.outputs import TokenOutputs

__all__ = ["fused_linear_cross_entropy", "fused_linear_logprobs"]


def _fused_loss(
    where: str, hidden: torch.Tensor, weight: torch.Tensor, options: LossOptions
) -> TokenOutputs:
    """The parsed call on its engine: agree, then one ``engine.loss`` over the flattened
    tokens. Its outputs shaped like ``target`` (engine reduction "none"), else reduced."""
    engine = load_engine(options)
    # under MP_BRIDGE_CHECK: one all-gather, before the engine's first collective
    options.agree(where, device=hidden.device, replicated={"hidden": hidden})
    flat = hidden.reshape(-1, hidden.shape[-1])
    target = options.target.reshape(-1)
    out = engine.loss(flat, weight, target, options.token_temperature, options)
    if options.engine_reduction != "none":
        return out
    return out.map(lambda v: v.view(hidden.shape[:-1]))


@agreed("mp_bridge.layers.fused_linear_cross_entropy")
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    ce_weight: torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    invariant: bool = False,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
    logits_precision: str = "fp32",
    engine: str = "auto",
    vocab_mesh_dim: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ full_weight[:vocab_size].T`` without materializing it.

    Equals ``F.cross_entropy(z, target, ignore_index=, label_smoothing=, reduction=)``
    with ``z = softcap(F.linear(hidden, full_weight)[..., :vocab_size].float()) /
    temperature`` (``softcap(x) = c tanh(x / c)``, none by default; ``temperature`` a
    float or a tensor broadcastable to ``target.shape``, per token or per sample,
    identical on every TP rank, no gradient), where ``full_weight`` concatenates the TP
    shards in rank order, plus ``z_loss_weight * logsumexp(z)**2`` per counted token
    (exactly nothing when 0); ``return_z_loss=True`` returns ``(loss, z_loss)``, the
    z-loss part reduced the same way (no gradient; for logging). ``ignore_index``: -100
    by default, ``None`` ignores no id. ``hidden [..., H]``, ``target [...]`` (any integer
    dtype, any leading shape; "none" returns ``target``'s shape). "mean" (the default,
    as ``F.cross_entropy``) divides by the number of non-ignored tokens of this call
    (combine across DP/CP with ``masked_mean``); over only ignored tokens it is nan with
    zero gradients, like torch. Returns fp32. ``chunk_size``: the number of tokens whose
    logits exist at once, in every engine and mode (the torch engine and the triton
    default mode take it as it is; the invariant modes round it up to their token tile:
    torch 128, triton 64 in fp32 and 128 in bf16 / fp16, capped so a chunk's ``[C,
    V_local]`` gradient stays under 2**31 elements); ``None``: the engine's default
    (torch: about ``DEFAULT_CHUNK_ELEMENTS`` logits per chunk; triton default: every
    token, in weight slabs of about ``SLAB_ELEMENTS`` logits; triton invariant: 1024 x TP).
    An engine that cannot bound it is a ``ValueError`` by name and never ``"auto"``'s
    choice when it is given. ``engine``: ``"auto"``
    (``"triton"`` for CUDA tensors it can run when it imports, else ``"torch"``),
    ``"torch"`` or ``"triton"`` (``ImportError`` without ``pip install triton``;
    ``ValueError`` naming the reason for an input it cannot run, e.g. fp64); the same on
    every TP rank. ``logits_precision="fp32"`` (default):
    bf16 / fp16 inputs are upcast once, so logits and gradients are fp32-accumulated
    (exact products, never rounded to the input dtype); ``"input"``: matmuls in the input
    dtype (logits rounded to it: log-prob errors 3e-2 to 5e-2 in bf16, 4e-3 to 8e-3 in fp16
    at logits ~ N(0, 16), against ~5e-6 exact; bench/lm_head_accuracy.py). Not
    twice differentiable; with "mean" / "sum" one backward per call (gradients are made
    in forward). ``ce_weight``: per-class weights ``[vocab_size]`` as
    ``vocab_parallel_cross_entropy``'s (``F.cross_entropy(weight=)``, with smoothing; "mean"
    divides it by the sum of the counted targets' weights; the z-loss is not weighted and its
    "mean" is over the counted tokens); on both engines.
    ``weight`` may be a ``DTensor``: ``Shard(0)`` over the mesh dim ``"tp"`` (or
    ``vocab_mesh_dim=``) is vocab parallelism over it, any other is a ``ValueError``
    (``dtensor_weight``).
    """
    hidden, weight, tp_group, vocab_size, shard_rows = local_operands(
        hidden, weight, target=target, temperature=temperature, ce_weight=ce_weight,
        tp_group=tp_group, vocab_size=vocab_size, vocab_mesh_dim=vocab_mesh_dim,
        invariant=invariant,
    )  # fmt: skip
    options = parse_loss_options(
        "ce", hidden=hidden, weight=weight, shard_rows=shard_rows, target=target,
        tp_group=tp_group, vocab_size=vocab_size, ignore_index=ignore_index,
        label_smoothing=label_smoothing, ce_weight=ce_weight, reduction=reduction,
        chunk_size=chunk_size, invariant=invariant, temperature=temperature, softcap=softcap,
        z_loss_weight=z_loss_weight, return_z_loss=return_z_loss,
        logits_precision=logits_precision, engine=engine, choose_engine=choose_engine,
    )  # fmt: skip
    out = _fused_loss("fused_linear_cross_entropy", hidden, weight, options)
    if not return_z_loss:
        return out.value
    z_loss = out.z_loss if out.z_loss is not None else torch.zeros_like(out.value.detach())
    return out.value, z_loss


@agreed("mp_bridge.layers.fused_linear_logprobs")
def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    invariant: bool = False,
    ignore_index: int | None = -100,
    softcap: float | None = None,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
    reduction: str = "none",
    logits_precision: str = "fp32",
    engine: str = "auto",
    vocab_mesh_dim: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``log_softmax(z)[target]`` ``[...]`` fp32, ``z = softcap(hidden @
    full_weight[:vocab_size].T) / temperature``; ``hidden [..., H]``, ``target [...]``.

    ``temperature``: a float or a tensor broadcastable to ``target.shape`` (per token or
    per sample; identical on every TP rank; no gradient). Every target must be in ``[0,
    vocab_size)``, except where it equals ``ignore_index`` (default -100, as on the
    cross-entropy; ``None``: none), which gives 0 on every output and gradient 0.
    ``return_entropy=True`` adds the entropy of the same ``softmax(z)`` (with gradient),
    ``return_sum_pi_squared=True`` adds ``sum_c softmax(z)_c**2`` (no gradient), in the
    order ``(logprobs, entropy, sum_pi_squared)``, from the same pass. ``reduction``:
    "none" (default), "sum" or "mean" over counted tokens, applied to every output.
    Gradients recompute logits in backward. ``logits_precision``, ``engine``, a ``DTensor``
    ``weight`` and ``vocab_mesh_dim``: as ``fused_linear_cross_entropy``.
    """
    hidden, weight, tp_group, vocab_size, shard_rows = local_operands(
        hidden, weight, target=target, temperature=temperature, tp_group=tp_group,
        vocab_size=vocab_size, vocab_mesh_dim=vocab_mesh_dim, invariant=invariant,
    )  # fmt: skip
    options = parse_loss_options(
        "logprob", hidden=hidden, weight=weight, shard_rows=shard_rows, target=target,
        tp_group=tp_group, vocab_size=vocab_size, temperature=temperature,
        chunk_size=chunk_size, invariant=invariant, ignore_index=ignore_index, softcap=softcap,
        return_entropy=return_entropy, return_sum_pi_squared=return_sum_pi_squared,
        reduction=reduction, logits_precision=logits_precision, engine=engine,
        choose_engine=choose_engine,
    )  # fmt: skip
    # per token from the engine, reduced here like every other output
    return options.returned(_fused_loss("fused_linear_logprobs", hidden, weight, options))
