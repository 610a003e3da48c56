"""Fused LM-head cross-entropy / log-probs: hidden states + vocab shard -> loss, no logits.

``hidden [N, H]`` is TP-replicated (identical on every rank of ``tp_group``), ``weight
[V_local, H]`` is this rank's ``VocabShard`` of the padded vocab (ids ``>= vocab_size``
are padding and never enter a softmax: the layout of ``VocabParallelLMHead`` or a tied
``VocabParallelEmbedding``), ``target [N]``. Tokens are processed in chunks of
``chunk_size`` rows by a ``ChunkEngine`` (``fused_engines``); at most one chunk's fp32
logits ``[chunk, V_local]`` exist at a time and the weight is never gathered. Statistics
and gradients accumulate in fp32 whatever the input dtype; outputs are fp32. bf16 / fp16
inputs are upcast once per call (one fp32 copy of ``hidden`` and of the shard), so logits
and every gradient matmul are exact fp32-accumulated products (``logits_precision="input"``
keeps the faster rounding mode). Options (``LossSpec``; the same names and defaults as
``vocab_parallel``): temperature (a float, or a tensor per token / per sample), soft-cap,
z-loss, ``ignore_index`` (default -100), ``reduction``, and on log-probs the entropy and
``sum_pi_squared`` of the same distribution from the same pass.

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
in ``reduce``): ``invariant=False``, one stats all-gather and one ``d hidden`` all-reduce;
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

from mp_bridge.checks import agreed
from mp_bridge.layers.loss.blocks import TOKEN_TILE, BlockLayout, pad_single_shard
from mp_bridge.layers.loss.call_spec import LossCall, parse_loss_call
from mp_bridge.layers.loss.checks import check_tp_agreement, forbid_double_backward
from mp_bridge.layers.loss.fused_engines import ChunkEngine, InvariantEngine, ShardEngine

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "fused_linear_cross_entropy", "fused_linear_logprobs"]

#: Default chunk: about this many fp32 logits (32 MiB) per chunk, at least 128 rows (a
#: smaller matmul loses BLAS efficiency). The same budget at every TP size: a chunk of
#: rows fixed in bytes would shrink as ``V_local`` does, and the per-chunk collectives and
#: small matmuls would make TP 2-4 slower than megatron's unchunked head (bench/RESULTS.md:
#: 8 MiB chunks gave 1.02-1.06x megatron's time at TP 2/4). The peak stays the fp32 d
#: weight and d hidden plus this one chunk, far below ``[N, V_local]`` logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 23


class _FusedLinearLoss(torch.autograd.Function):
    """The chunk driver. Adjoint: ``d hidden`` rows reduced over TP by the engine, ``d
    weight`` local to the shard. See the module docstring for when each is computed.
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
        for rows in _chunks(n, chunk):
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
            for rows in _chunks(hidden.shape[0], chunk):
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


def _chunks(n: int, chunk: int):
    for s in range(0, n, chunk):
        yield slice(s, min(s + chunk, n))


#: ``engine=`` of the fused doors: "auto" is "triton" for CUDA tensors, else "torch".
ENGINES = ("auto", "torch", "triton")


def _use_triton(engine: object, hidden: torch.Tensor, call: LossCall) -> bool:
    """Whether this call runs on the triton engine (imported only then)."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {ENGINES}")
    if engine == "torch" or (engine == "auto" and not hidden.is_cuda):
        return False
    from mp_bridge.layers.loss.engines.triton import fallback_reason

    return fallback_reason(hidden, call) is None


def _fused_loss(hidden, weight, call: LossCall, reduction: str, engine: object = "torch"):
    """Build the engine of the parsed ``call`` and run the loss (``reduction`` here, the
    call's own or "none").

    Returns ``(values, extra, sq)`` shaped like ``target`` (``reduction="none"``) or
    scalars.
    """
    if _use_triton(engine, hidden, call):
        from mp_bridge.layers.loss.engines.triton import triton_fused_loss

        return triton_fused_loss(hidden, weight, call, reduction)
    lead = tuple(hidden.shape[:-1])
    v_local = weight.shape[0]
    spec = call.spec()
    token_temp = call.token_temperature
    if token_temp is not None:
        token_temp = token_temp.to(torch.float32).reshape(-1)
    target = call.target.reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    tp_group, chunk_size, invariant = call.tp_group, call.chunk_size, call.flag("invariant")
    if call.logits_precision == "fp32" and hidden.dtype in (torch.bfloat16, torch.float16):
        # Products of bf16 / fp16 values are exact in fp32: the logits (and every gradient
        # matmul) are fp32-accumulated and never rounded to the input dtype.
        hidden, weight = hidden.float(), weight.float()
    if chunk_size is None:
        chunk_size = max(128, DEFAULT_CHUNK_ELEMENTS // v_local)
    chunk = max(1, min(chunk_size, hidden.shape[0]))
    check_tp_agreement(  # under MP_BRIDGE_CHECK: one all-gather, before the chunk loop
        "fused linear loss",
        tp_group,
        {"hidden": hidden, "weight": weight},
        {"spec": spec, "chunk": chunk, "invariant": invariant, "reduction": reduction},
        {"hidden": hidden, "target": target, "temperature": token_temp},
    )
    if invariant:
        layout = BlockLayout.of_shard(call.shard)
        chunk = -(-chunk // TOKEN_TILE) * TOKEN_TILE  # tiles must not depend on the chunk
        # TP = 1 with a vocab that is not a whole number of blocks: one zero-padded copy.
        weight = pad_single_shard(weight, 0, layout)
        engine: ChunkEngine = InvariantEngine(weight, tp_group, layout, spec)
    else:
        engine = ShardEngine(weight, tp_group, call.shard, spec)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    values, extra, sq = _FusedLinearLoss.apply(
        hidden, weight, target, engine, spec, chunk, reduction, needs_grad, token_temp
    )
    if reduction == "none":
        values = values.view(lead)
        extra = extra.view(lead) if extra.numel() == values.numel() else extra
        sq = sq.view(lead) if sq.numel() == values.numel() else sq
    return values, extra, sq


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
    reduction: str = "mean",
    chunk_size: int | None = None,
    invariant: bool = False,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
    logits_precision: str = "fp32",
    engine: str = "auto",
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
    zero gradients, like torch. Returns fp32. ``chunk_size=None``: about
    ``DEFAULT_CHUNK_ELEMENTS`` logits per chunk. ``logits_precision="fp32"`` (default):
    bf16 / fp16 inputs are upcast once, so logits and gradients are fp32-accumulated
    (exact products, never rounded to the input dtype); ``"input"``: matmuls in the input
    dtype (logits rounded to it: log-prob errors 3e-2 to 5e-2 in bf16, 4e-3 to 8e-3 in fp16
    at logits ~ N(0, 16), against ~5e-6 exact; bench/lm_head_accuracy.py). Not
    twice differentiable; with "mean" / "sum" one backward per call (gradients are made
    in forward). ``engine``: "auto" (default: "triton" for CUDA tensors, else "torch"),
    "torch" or "triton" (``engines.triton``; fp64 falls back to "torch" with a warning).
    """
    call = parse_loss_call("ce", locals())
    loss, z_loss, _ = _fused_loss(hidden, weight, call, call.reduction, engine)
    if not return_z_loss:
        return loss
    return loss, z_loss if call.z_loss_weight != 0.0 else torch.zeros_like(loss.detach())


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
    Gradients recompute logits in backward. ``logits_precision``: as
    ``fused_linear_cross_entropy``; ``engine``: as there.
    """
    call = parse_loss_call("logprob", locals())
    # reduced by the call, like every other output (backward recomputes)
    out = _fused_loss(hidden, weight, call, "none", engine)
    return call.returned(*out)
