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
from mp_bridge.layers.loss.engines.triton.block_stats import BK, NUM_WARPS, TILE_M
from mp_bridge.layers.loss.engines.triton.tiles import (
    INTERPRET,
    block_logits,
    tile_grad,
    transform,
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
    temp_ptr,
    tcol_ptr,
    lse_ptr,
    w_tok_ptr,
    went_ptr,
    ent_ptr,
    n_rows,
    hidden,
    w_rows,
    num_valid,
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
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    tcol = tl.load(tcol_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_tok_ptr + rows, mask=rmask, other=0.0)
    w_ent = tl.zeros((TILE_M,), tl.float32)
    ent = tl.zeros((TILE_M,), tl.float32)
    if HAS_ENT:
        w_ent = tl.load(went_ptr + rows, mask=rmask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
    z, deriv = transform(x, temp, cap, HAS_CAP)
    valid = rmask[:, None] & (cols < num_valid)[None, :]
    is_target = valid & (cols[None, :] == tcol[:, None])
    g = tile_grad(
        z, deriv, valid, is_target, lse, w, w_ent, ent, coef_a, coef_b, coef_c, zw2,
        HAS_Z, HAS_ENT, HAS_CAP,
    )  # fmt: skip
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, g.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def block_grad(
    h, weight, temp, tcol, lse, w, w_ent, ent, *, n_blocks: int, num_valid: int, spec: LossSpec
) -> torch.Tensor:
    """``g [C, K * BLOCK]`` in ``h``'s dtype for chunk ``h [C, H]`` (0 off true columns)."""
    n, hd = h.shape
    out = torch.empty((n, n_blocks * VOCAB_BLOCK), dtype=h.dtype, device=h.device)
    if n == 0 or n_blocks == 0:
        return out
    a, b, c = spec.coefficients
    _block_grad_kernel[(triton.cdiv(n, TILE_M), n_blocks)](
        h,
        h.stride(0),
        weight,
        weight.stride(0),
        out,
        out.stride(0),
        temp,
        tcol,
        lse,
        w,
        w if w_ent is None else w_ent,
        w if ent is None else ent,
        n,
        hd,
        weight.shape[0],
        num_valid,
        float(spec.softcap or 1.0),
        a,
        b,
        c,
        2.0 * spec.z_loss_weight,
        HAS_CAP=spec.softcap is not None,
        HAS_Z=spec.z_loss_weight != 0.0,
        HAS_ENT=spec.entropy,
        TILE_M=TILE_M,
        BLOCK=VOCAB_BLOCK,
        BK=BK,
        INTERPRET=INTERPRET,
        num_warps=NUM_WARPS,
    )
    return out
