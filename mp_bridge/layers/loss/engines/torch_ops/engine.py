"""The ``"torch"`` engine: chunked torch matmuls, the CPU path and the reference engine.

Tokens are processed in chunks of ``chunk_size`` rows (the tokens whose logits exist at
once; ``None``: about ``DEFAULT_CHUNK_ELEMENTS`` logits, at least 128 rows) by the runner
of the mode
(``default.TorchDefaultRunner``, ``invariant.TorchInvariantRunner`` with
``options.invariant``) under one autograd Function (``driver.FusedLinearLoss``); at most one
chunk's fp32 logits ``[chunk, V_local]`` exist at a time and the weight is never gathered.
bf16 / fp16 inputs are upcast once per call with ``logits_precision="fp32"`` (one fp32 copy
of ``hidden`` and of the shard), so logits and every gradient matmul are exact
fp32-accumulated products; ``"input"`` keeps the input dtype (faster, rounded logits).

Collectives per chunk over ``tp_group`` (``k = ceil(N / chunk)`` chunks; the shapes are
in ``reduce``): default, one stats all-gather and one ``d hidden`` all-reduce; invariant,
one stats all-gather and one ``d hidden`` all-gather of subtree partials. Invariant mode
rounds ``chunk`` up to a multiple of ``TOKEN_TILE``; values and gradients are then
bitwise identical for every TP size whose shard is a multiple of ``VOCAB_BLOCK`` rows (at
TP = 1 any ``[V, H]`` weight: it is zero-padded to whole blocks by one copy), for any
``chunk_size``, and whatever other tokens share the call; ``d weight`` sums tokens tile by
tile in token order, so it is also unchanged by extra tokens appended with zero upstream
gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mp_bridge.layers.loss.blocks import TOKEN_TILE, BlockLayout, pad_single_shard
from mp_bridge.layers.loss.engines.torch_ops.default import TorchDefaultRunner
from mp_bridge.layers.loss.engines.torch_ops.driver import ChunkRunner, FusedLinearLoss
from mp_bridge.layers.loss.engines.torch_ops.invariant import TorchInvariantRunner
from mp_bridge.layers.loss.outputs import TokenOutputs

if TYPE_CHECKING:
    from mp_bridge.layers.loss.options import LossOptions

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ENGINE", "TorchEngine"]

#: Default chunk: about this many fp32 logits (32 MiB) per chunk, at least 128 rows (a
#: smaller matmul loses BLAS efficiency). The same budget at every TP size: a chunk of
#: rows fixed in bytes would shrink as ``V_local`` does, and the per-chunk collectives and
#: small matmuls would make TP 2-4 slower than megatron's unchunked head (bench/RESULTS.md:
#: 8 MiB chunks gave 1.02-1.06x megatron's time at TP 2/4). The peak stays the fp32 d
#: weight and d hidden plus this one chunk, far below ``[N, V_local]`` logits.
DEFAULT_CHUNK_ELEMENTS = 1 << 23


class TorchEngine:
    """The ``FusedLossEngine`` of torch ops (``protocol``); every option, any device."""

    name = "torch"

    def unsupported(self, inputs) -> str | None:
        return None  # the reference: every input, every option, every mode

    def loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        temperature: torch.Tensor | None,
        options: LossOptions,
    ) -> TokenOutputs:
        # the layout's rows, the same on every rank (a DTensor's shard may hold fewer): the
        # chunks, and so the collectives, must not depend on this rank's rows
        spec, v_local = options.spec, options.shard.size
        if options.logits_precision == "fp32" and hidden.dtype in (torch.bfloat16, torch.float16):
            # Products of bf16 / fp16 values are exact in fp32: the logits (and every
            # gradient matmul) are fp32-accumulated and never rounded to the input dtype.
            hidden, weight = hidden.float(), weight.float()
        chunk_size = options.chunk_size
        if chunk_size is None:
            chunk_size = max(128, DEFAULT_CHUNK_ELEMENTS // v_local)
        chunk = max(1, min(chunk_size, hidden.shape[0]))
        if options.invariant:
            layout = BlockLayout.of_shard(options.shard)
            chunk = -(-chunk // TOKEN_TILE) * TOKEN_TILE  # tiles must not depend on the chunk
            # TP = 1 with a vocab that is not a whole number of blocks, or a DTensor's short
            # last shard: one zero-padded copy of the shard to whole blocks.
            weight = pad_single_shard(weight, 0, layout)
            runner: ChunkRunner = TorchInvariantRunner(weight, options.tp_group, layout, spec)
        else:
            runner = TorchDefaultRunner(weight, options.tp_group, options.shard, spec)
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        reduction = options.engine_reduction
        out = FusedLinearLoss.apply(
            hidden, weight, target, runner, spec, chunk, reduction, needs_grad, temperature
        )
        return TokenOutputs(*out)


#: The instance the registry loads (``registry.ENGINE_CAPS["torch"]``).
ENGINE = TorchEngine()
