"""Invariant mode, backward step 1: the logits' gradient of every (token tile, vocab
block), recomputed in registers by the forward's own ``block_logits`` (the same bits; at
``WIDE_M`` rows as two column halves: the same sums, the same MMA shape).

Grid ``(ceil(C / T), K)`` over a chunk of ``C`` tokens (``T``: ``WIDE_M`` rows in a
16-divisible build, else ``NARROW_M``; fp32: ``row_tile``): program ``(i, j)`` rebuilds
the ``[T, BLOCK]`` logits, applies ``transform`` and ``tile_grad`` from the rows'
global ``lse`` / entropy and factors ``w`` / ``w_ent``, and writes ``g`` to ``out [C,
K * BLOCK]`` in the input dtype (the operand of the two gradient products). Element-wise
per row: no bit depends on another token or on the TP size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops.block_stats import (
    NUM_WARPS,
    aligned,
    row_tile,
    stats_build,
)
from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    INTERPRET,
    block_logits,
    grad_of,
    grad_params,
    rounded,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["NARROW_M", "WIDE_M", "block_grad"]

#: Token rows per program (bf16 / fp16) where the JIT's build has 16-divisible shapes and
#: pointers (vectorized ``cp.async`` loads) and the call has no option flag: two ``[128,
#: 128]`` accumulators, ``wgmma m64n128k16`` as at ``NARROW_M = 64`` rows, epilogue one half
#: at a time. Without that divisibility the unvectorized loads spill at 128 rows, and with
#: a flag (soft-cap, z-loss, entropy, class weights) the epilogue beside the second
#: accumulator spills (8 to 400 B), so the tile is ``NARROW_M`` (twice the weight tile
#: loads per token, predicted); the row tile moves no bit (each row is its own dot, ``k``
#: in order). The ``k`` step and the
#: pipelining depth are ``block_stats.stats_build``'s (bf16 / fp16: 16, 5 stages): the
#: recomputed logits are the forward's, bit for bit, on a GPU and under the interpreter.
WIDE_M = 128
NARROW_M = 64


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
    cw_ptr,
    cap,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    HAS_CAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_CW: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    rmask = rows < n_rows
    # WIDE_M rows: two [TILE_M, BLOCK / 2] accumulators, the epilogue one half at a time
    HALF: tl.constexpr = BLOCK // 2 if TILE_M > 64 else BLOCK
    cols = tl.program_id(1) * BLOCK + tl.arange(0, HALF)
    xa, xb = block_logits(
        h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols, w_rows, hidden,
        TILE_M, BLOCK, BK, INTERPRET, HALF < BLOCK,
    )  # fmt: skip
    for half in tl.static_range(BLOCK // HALF):
        x = xa
        if half == 1:
            x = xb
        ids = cols + half * HALF
        g = grad_of(
            x, ids, rmask[:, None], rows, rmask, temp_ptr, tcol_ptr, lse_ptr, w_tok_ptr,
            went_ptr, ent_ptr, cw_ptr, num_valid, cap, coef_a, coef_b, coef_c, zw2, HAS_CAP,
            HAS_Z, HAS_ENT, HAS_CW,
        )  # fmt: skip
        out = out_ptr + rows[:, None] * out_stride + ids[None, :]
        tl.store(out, rounded(g, out_ptr, INTERPRET), mask=rmask[:, None])


def block_grad(
    h,
    weight,
    temp,
    tcol,
    lse,
    w,
    w_ent,
    ent,
    *,
    n_blocks: int,
    num_valid: int,
    spec: LossSpec,
    colw=None,
    wab=None,
) -> torch.Tensor:
    """``g [C, K * BLOCK]`` in ``h``'s dtype for chunk ``h [C, H]`` (0 off true columns).
    With class weights: ``colw`` the shard's fp32 column weights (by local id), ``wab``
    the chunk's per-token ``(w a, w b)`` (``tiles.grad_params``)."""
    n, hd = h.shape
    out = torch.empty((n, n_blocks * VOCAB_BLOCK), dtype=h.dtype, device=h.device)
    if n == 0 or n_blocks == 0:
        return out
    args, flags = grad_params(spec, w, w_ent, ent, colw, wab)
    tm = row_tile(h.dtype)
    is_aligned = aligned(h, weight, out, n, hd, weight.shape[0], h.stride(0), weight.stride(0))
    # block_stats' k step (the same logits bits) and its pipelining depth
    build, stages = stats_build(h.dtype, is_aligned)
    if h.dtype != torch.float32:
        tm = WIDE_M if is_aligned and not any(flags.values()) else NARROW_M
    _block_grad_kernel[(triton.cdiv(n, tm), n_blocks)](
        h, h.stride(0), weight, weight.stride(0), out, out.stride(0), n, hd, weight.shape[0],
        num_valid, temp, tcol, lse, *args, **flags, TILE_M=tm, BLOCK=VOCAB_BLOCK,
        BK=build["BK"], INTERPRET=INTERPRET, num_warps=NUM_WARPS, num_stages=stages,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out
