"""Invariant mode, backward step 1: the logits' gradient of every (token tile, vocab
block), recomputed in registers by the forward's own ``block_logits`` (the same bits).

Grid ``(ceil(C / TILE_M), K)`` over a chunk of ``C`` tokens: program ``(i, j)`` rebuilds
the ``[TILE_M, BLOCK]`` logits, applies ``transform`` and ``tile_grad`` from the rows'
global ``lse`` / entropy and factors ``w`` / ``w_ent``, and writes ``g`` to ``out [C,
K * BLOCK]`` in the input dtype (the operand of the two gradient products). Element-wise
per row: no bit depends on another token or on the TP size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops.block_stats import BK, NUM_STAGES, NUM_WARPS, TILE_M
from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    INTERPRET,
    block_logits,
    grad_of,
    grad_params,
    rounded,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["block_grad"]


@triton.jit
def _block_grad_kernel(
    h_ptr,
    h_stride,
    w_ptr,
    w_stride,
    out_ptr,
    out_stride,
    n_rows,
    hidden,
    w_rows,
    num_valid,
    temp_ptr,
    tcol_ptr,
    lse_ptr,
    w_tok_ptr,
    went_ptr,
    ent_ptr,
    cap,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    HAS_CAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    x = block_logits(
        h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols, w_rows, hidden,
        TILE_M, BLOCK, BK, INTERPRET,
    )  # fmt: skip
    g = grad_of(
        x, cols, rmask[:, None], rows, rmask, temp_ptr, tcol_ptr, lse_ptr, w_tok_ptr, went_ptr,
        ent_ptr, num_valid, cap, coef_a, coef_b, coef_c, zw2, HAS_CAP, HAS_Z, HAS_ENT,
    )  # fmt: skip
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, rounded(g, out_ptr, INTERPRET), mask=rmask[:, None])


def block_grad(
    h, weight, temp, tcol, lse, w, w_ent, ent, *, n_blocks: int, num_valid: int, spec: LossSpec
) -> torch.Tensor:
    """``g [C, K * BLOCK]`` in ``h``'s dtype for chunk ``h [C, H]`` (0 off true columns)."""
    n, hd = h.shape
    out = torch.empty((n, n_blocks * VOCAB_BLOCK), dtype=h.dtype, device=h.device)
    if n == 0 or n_blocks == 0:
        return out
    args, flags = grad_params(spec, w, w_ent, ent)
    _block_grad_kernel[(triton.cdiv(n, TILE_M), n_blocks)](
        h, h.stride(0), weight, weight.stride(0), out, out.stride(0), n, hd, weight.shape[0],
        num_valid, temp, tcol, lse, *args, **flags, TILE_M=TILE_M, BLOCK=VOCAB_BLOCK, BK=BK,
        INTERPRET=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out
