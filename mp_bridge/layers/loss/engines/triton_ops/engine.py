"""The ``"triton"`` engine (``ENGINE``, the ``FusedLossEngine`` of ``engines.protocol``):
its autograd Function and the call.

Forward: the runner's global statistics ``[S, N]`` (``TritonDefaultRunner`` by default,
``TritonInvariantRunner`` with ``invariant=True``) -> ``formulas.stats_values`` -> the
per-token ``TokenOutputs`` (0 at ``ignore_index``). Backward: ``w = (1 / T)
x upstream`` per token (0 at ``ignore_index``; ``w_ent`` likewise for the entropy) -> the
runner's ``d h`` (reduced over TP) and ``d W`` (this shard). The reductions ("sum" /
"mean") are autograd-tracked torch ops on the per-token values
(``outputs.reduce_tokens``), so both modes recompute the logits in backward whatever the
reduction: no fp32 ``d W`` is held from forward to backward.

Every option of ``LossSpec`` (temperature, float or per token, soft-cap, z-loss, label
smoothing, ``ignore_index``, the extra per-token outputs, the per-class weights
``ce_weight``) runs in the kernels (``tiles``). Class weights (``class_weights``): the
values take the tokens' ``omega`` on the kernels' statistics (the sum weighted by the
columns' weights, in the kernels, only with smoothing); backward hands the kernels ``w a``
and ``w b`` per token (``token_coefficients``) and the column weights. Without them the
kernels compile the weight code out (a ``HAS_CW`` constexpr): the same builds and bits.
Without smoothing and z-loss (``a = omega``, ``b = -omega``, ``c = 0``) the gradient is
the unweighted kernels' for ``w omega`` (``(w omega) 1 = w a``, ``(w omega) (-1) = w b``
bit for bit), so that common case runs the unweighted builds only.
What it takes is data (``registry.ENGINE_CAPS["triton"]``: CUDA tensors, CPU ones under
``TRITON_INTERPRET=1``; fp32 / bf16 / fp16); ``unsupported`` names the one shape limit, a
weight shard of ``2**31`` or more elements (int32 offsets). An explicit ``engine="triton"``
then raises; ``"auto"`` picks the torch engine. ``logits_precision`` is not an option here:
the logits are always fp32-accumulated from the input dtype (``"fp32"``'s result, at GEMM
speed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mp_bridge.layers.loss.arguments import forbid_double_backward
from mp_bridge.layers.loss.class_weights import target_weights, token_coefficients
from mp_bridge.layers.loss.engines.triton_ops.default import TritonDefaultRunner
from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner
from mp_bridge.layers.loss.formulas import stats_values
from mp_bridge.layers.loss.outputs import TokenOutputs, counted_tokens, reduce_tokens

if TYPE_CHECKING:
    from mp_bridge.layers.loss.options import LossOptions

__all__ = ["ENGINE", "TritonEngine"]

#: The kernels index with int32 offsets: a weight shard (and so ``d W``) must stay below.
_MAX_OFFSET = 2**31


class _TritonLinearLoss(torch.autograd.Function):
    """The ``TokenOutputs.tensors`` of one call, fp32 ``[N]``, 0 at ``ignore_index``."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temp, runner):
        spec = runner.spec
        tcol = runner.columns(target)
        omega = target_weights(spec, target)
        out = stats_values(runner.stats(hidden, tcol, temp), spec, omega=omega)
        if spec.ignore_index is not None:
            out = out.masked(target == spec.ignore_index)
        ctx.runner = runner
        ctx.save_for_backward(hidden, target, temp, tcol, out.lse, out.entropy)
        return out.tensors(ctx)

    @staticmethod
    def backward(ctx, g_values, g_entropy, g_z_loss, g_sq):
        forbid_double_backward("fused_linear_cross_entropy / fused_linear_logprobs (triton)")
        hidden, target, temp, tcol, lse, ent = ctx.saved_tensors
        runner = ctx.runner
        token = runner.spec.token_weight(target, temp)  # 1 / T, 0 at ignore_index
        counted = token != 0

        def factor(up):  # 0 where ignored, even if the upstream gradient is inf / nan
            return torch.where(counted, token * up.float(), 0.0)

        w = factor(g_values)
        w_ent = factor(g_entropy) if runner.spec.entropy else None
        wab, spec = None, runner.spec
        if spec.class_weight is not None:
            omega = target_weights(spec, target)
            if spec.with_sum or spec.z_loss_weight != 0.0:  # (w a, w b) per token, as grad's
                a, b, _ = token_coefficients(spec, omega)
                wab = ((w * a).float().contiguous(), (w * b).float().contiguous())
            else:  # a = omega, b = -omega, c = 0: the unweighted kernels' bits for w omega
                w = (w * omega).float()
        want_gw = ctx.needs_input_grad[1]
        gh, gw = runner.grads(hidden, tcol, temp, lse, w, w_ent, ent, want_gw, wab=wab)
        grad_h = gh.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_h, gw, None, None, None


class TritonEngine:
    """The GPU engine: ``TritonDefaultRunner`` (default) or ``TritonInvariantRunner``
    (``invariant=True``)."""

    name = "triton"

    def unsupported(self, inputs) -> str | None:
        # the dtypes and devices it takes are data: registry.ENGINE_CAPS["triton"]
        for name, shape, _ in inputs:
            if name == "weight" and math.prod(shape) >= _MAX_OFFSET:
                return f"weight {tuple(shape)} of 2**31 or more elements (int32 offsets)"
        return None

    def loss(self, hidden, weight, target, temperature, options: LossOptions) -> TokenOutputs:
        spec = options.spec
        h, w = hidden.contiguous(), weight.contiguous()
        temp = spec.temperatures(temperature, target.shape[0], h.device)  # the kernels: [N]
        if options.invariant:
            runner = TritonInvariantRunner.build(
                w, options.tp_group, options.shard, spec, options.chunk_size
            )
        else:
            runner = TritonDefaultRunner(
                w, options.tp_group, options.shard, spec, chunk=options.chunk_size
            )
        out = TokenOutputs(*_TritonLinearLoss.apply(h, w, target, temp, runner))
        reduction = options.engine_reduction
        if reduction == "none":
            return out
        counted = counted_tokens(target, spec.ignore_index)
        return out.map(lambda v: reduce_tokens(v, counted, reduction))


#: The instance the registry loads (``registry.ENGINE_CAPS["triton"]``).
ENGINE = TritonEngine()
