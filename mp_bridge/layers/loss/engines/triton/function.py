"""The ``"triton"`` engine (``ENGINE``, the ``FusedLossEngine`` of ``engines.protocol``):
its autograd Function and the call.

Forward: the runner's global statistics ``[S, N]`` (``VocabMajor`` by default,
``BlockTiles`` with ``invariant=True``) -> ``formulas.stats_values`` -> per-token value,
entropy, ``sum_pi_squared`` and z-loss (0 at ``ignore_index``). Backward: ``w = (1 / T)
x upstream`` per token (0 at ``ignore_index``; ``w_ent`` likewise for the entropy) -> the
runner's ``d h`` (reduced over TP) and ``d W`` (this shard). The reductions ("sum" /
"mean") are autograd-tracked torch ops on the per-token values
(``outputs.reduce_tokens``), so both modes recompute the logits in backward whatever the
reduction: no fp32 ``d W`` is held from forward to backward.

Temperature (float or per token), soft-cap, z-loss, label smoothing, ``ignore_index``,
entropy and ``sum_pi_squared`` all run in the kernels (``tiles``); ``unsupported`` names
only fp64 inputs (the kernels take fp32 / bf16 / fp16) and a weight shard of ``2**31`` or
more elements (int32 offsets), which the door then runs on the torch engine with a
warning. ``logits_precision`` is not an option here: the logits are
always fp32-accumulated from the input dtype (``"fp32"``'s result, at GEMM speed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mp_bridge.layers.loss.arguments import forbid_double_backward
from mp_bridge.layers.loss.engines.protocol import EngineOutput
from mp_bridge.layers.loss.engines.triton.block_tiles import BlockTiles
from mp_bridge.layers.loss.engines.triton.vocab_major import VocabMajor
from mp_bridge.layers.loss.formulas import stats_values
from mp_bridge.layers.loss.outputs import counted_tokens, reduce_tokens

if TYPE_CHECKING:
    from mp_bridge.layers.loss.options import LossOptions

__all__ = ["ENGINE", "TritonEngine"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The kernels index with int32 offsets: a weight shard (and so ``d W``) must stay below.
_MAX_OFFSET = 2**31


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


class TritonEngine:
    """The GPU engine: ``VocabMajor`` (default) or ``BlockTiles`` (``invariant=True``)."""

    name = "triton"

    def unsupported(self, options: LossOptions) -> str | None:
        for name, shape, dtype in options.inputs:
            if dtype not in _DTYPES:
                return f"{name} dtype {dtype} (the kernels take fp32, bf16, fp16)"
            if name == "weight" and math.prod(shape) >= _MAX_OFFSET:
                return f"weight {tuple(shape)} of 2**31 or more elements (int32 offsets)"
        return None

    def loss(self, hidden, weight, target, temperature, options: LossOptions) -> EngineOutput:
        spec = options.spec
        h, w = hidden.contiguous(), weight.contiguous()
        if temperature is None:
            temp = torch.full(target.shape, spec.temperature, dtype=torch.float32, device=h.device)
        else:
            temp = temperature.to(torch.float32).contiguous()
        if options.invariant:
            runner = BlockTiles.build(w, options.tp_group, options.shard, spec, options.chunk_size)
        else:
            runner = VocabMajor(w, options.tp_group, options.shard, spec)
        values, ent, sq, z_loss = _TritonLinearLoss.apply(h, w, target, temp, runner)
        extra = ent if spec.entropy else z_loss
        reduction = options.engine_reduction
        if reduction != "none":
            counted = counted_tokens(target, spec.ignore_index)
            values = reduce_tokens(values, counted, reduction)
            extra = reduce_tokens(extra, counted, reduction) if extra.numel() else extra
        return EngineOutput(values, extra, sq)


#: The instance the registry loads (``registry.ENGINE_MODULES["triton"]``).
ENGINE = TritonEngine()
