"""The triton engine's autograd Function and its entry point (``triton_fused_loss``).

Forward: the runner's global statistics ``[S, N]`` (``VocabMajor`` by default,
``BlockTiles`` with ``invariant=True``) -> ``formulas.stats_values`` -> per-token value,
entropy, ``sum_pi_squared`` and z-loss (0 at ``ignore_index``). Backward: ``w = (1 / T)
x upstream`` per token (0 at ``ignore_index``; ``w_ent`` likewise for the entropy) -> the
runner's ``d h`` (reduced over TP) and ``d W`` (this shard). The reductions
("sum" / "mean") are taken by autograd-tracked torch ops on the per-token values
(``outputs.reduce_tokens``), so both modes recompute the logits in backward whatever the
reduction: no fp32 ``d W`` is held from forward to backward.

Temperature, soft-cap, z-loss, label smoothing, ``ignore_index``, entropy and
``sum_pi_squared`` run in the kernels (``tiles``); fp64 inputs fall back to the torch
engine (``fallback_reason``). ``logits_precision`` does not apply: the logits are always
fp32-accumulated from the input dtype, which is ``"fp32"``'s result at ``"input"``'s cost.
"""

from __future__ import annotations

import warnings

import torch

from mp_bridge.layers.loss.call_spec import LossCall
from mp_bridge.layers.loss.checks import forbid_double_backward
from mp_bridge.layers.loss.engines.triton.block_tiles import BlockTiles
from mp_bridge.layers.loss.engines.triton.vocab_major import VocabMajor
from mp_bridge.layers.loss.formulas import stats_values
from mp_bridge.layers.loss.outputs import counted_tokens, reduce_tokens

__all__ = ["fallback_reason", "triton_fused_loss"]

_WARNED: set[str] = set()
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fallback_reason(hidden: torch.Tensor, call: LossCall) -> str | None:
    """Why this call must run on the torch engine instead (``None``: it need not); warns
    once per reason."""
    reason = None
    if hidden.dtype not in _DTYPES:
        reason = f"dtype {hidden.dtype} (the kernels take fp32, bf16 and fp16)"
    if reason is not None and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"engine='triton' falls back to 'torch' for {reason}", stacklevel=3)
    return reason


class _TritonLinearLoss(torch.autograd.Function):
    """Per-token ``(values, entropy, sum_pi_squared, z_loss)`` fp32 ``[N]`` (empty when
    not asked for); only ``values`` and ``entropy`` carry gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temp, runner):
        spec = runner.spec
        tcol = runner.columns(target)
        rv = stats_values(runner.stats(hidden, tcol, temp), spec)
        keep = None if spec.ignore_index is None else target != spec.ignore_index

        def masked(v):
            if v is None:
                return hidden.new_zeros(0, dtype=torch.float32)
            return v if keep is None else torch.where(keep, v, 0.0)

        values, ent = masked(rv.value), masked(rv.entropy)
        sq, z_loss = masked(rv.sum_pi_squared), masked(rv.z_loss)
        ctx.runner = runner
        ctx.save_for_backward(hidden, target, temp, tcol, rv.lse, ent)
        ctx.mark_non_differentiable(sq, z_loss)
        return values, ent, sq, z_loss

    @staticmethod
    def backward(ctx, g_values, g_ent, g_sq, g_z):
        forbid_double_backward("fused_linear_cross_entropy / fused_linear_logprobs (triton)")
        hidden, target, temp, tcol, lse, ent = ctx.saved_tensors
        runner = ctx.runner
        token = runner.spec.token_weight(target, temp)  # 1 / T, 0 at ignore_index
        counted = token != 0

        def factor(up):  # 0 where ignored, even if the upstream gradient is inf / nan
            return torch.where(counted, token * up.float(), 0.0)

        w = factor(g_values)
        w_ent = factor(g_ent) if runner.spec.entropy else None
        gh, gw = runner.grads(
            hidden, tcol, temp, lse, w, w_ent, ent if runner.spec.entropy else None,
            ctx.needs_input_grad[1],
        )  # fmt: skip
        grad_h = gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_h, gw, None, None, None


def triton_fused_loss(hidden: torch.Tensor, weight: torch.Tensor, call: LossCall, reduction):
    """``(values, extra, sq)`` of the fused ``call`` (the contract of ``fused._fused_loss``):
    shaped like the tokens with ``reduction="none"``, else scalars; ``extra`` the entropy
    (log-probs with ``return_entropy``), else the z-loss (cross-entropy with a weight),
    else empty; ``sq`` ``sum_pi_squared`` (``reduction="none"``), else empty."""
    lead = tuple(hidden.shape[:-1])
    spec = call.spec()
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    target = call.target.reshape(-1)
    if call.token_temperature is not None:
        temp = call.token_temperature.to(torch.float32).reshape(-1).contiguous()
    else:
        temp = torch.full(target.shape, call.temperature, dtype=torch.float32, device=h.device)
    w = weight.contiguous()
    if call.flag("invariant"):
        runner = BlockTiles.build(w, call.tp_group, call.shard, spec, call.chunk_size)
    else:
        runner = VocabMajor(w, call.tp_group, call.shard, spec)
    values, ent, sq, z_loss = _TritonLinearLoss.apply(h, w, target, temp, runner)
    extra = ent if spec.entropy else z_loss
    counted = counted_tokens(target, call.ignore_index)
    if reduction == "none":
        return tuple(v.view(lead) if v.numel() else v for v in (values, extra, sq))
    values = reduce_tokens(values, counted, reduction)
    extra = reduce_tokens(extra, counted, reduction) if extra.numel() else extra
    return values, extra, values.new_zeros(0)
