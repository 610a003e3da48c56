"""Invariant mode, backward step 2: ``d h`` by token-row ownership, one plain GEMM per chunk.

``out [C, Hc] fp32 = g [C, Vreal] @ W [Vreal, Hc]``: the whole real vocab (``Vreal =
K_real * 256`` rows, every real block of every rank) in ONE sequential ``k`` loop, ``BK``
rows per step from row 0, in order: no tree, no split-K, no atomics. Grid ``(ceil(C /
TILE_M), ceil(Hc / BH))``, token tiles fastest (the programs in flight share each ``W``
column slice): program ``(i, c)`` owns output tile ``[TILE_M, BH]`` and accumulates it in
registers (``dot_acc``; bf16 / fp16: one ``[128, 256]`` accumulator, ``wgmma
m64n256k16``; fp32: an FMA ``[32, 64]`` tile in ``"ieee"`` precision). Each element's
bits depend on its own ``g`` row, its own ``W`` column and the ``k`` order alone, never
on the tile it sits in, the chunk or the TP size: the ``k`` steps see the same global
vocab rows at the same positions (the MMA's ``k16`` groups included) at every TP size.

Layout: ``g`` and ``W`` come in *pieces* of ``piece`` vocab rows in vocab order (global
row ``v`` is row ``v % piece`` of piece ``v // piece``; ``piece`` a multiple of 256, so a
``k`` step never straddles two), so the all-to-all'd ``[TP, C / TP, piece]`` ``g`` rows
and the all-gathered ``[TP, piece, Hg]`` weight are read where they land, with no copy:

- TP = 1: ``g [C, K * 256]`` (``block_grad``'s output) and the weight shard ``[V_local,
  H]``, one piece; weight rows past ``V_local`` (``w_rows``) load as zeros.
- TP > 1 (``triton_ops.invariant.TritonInvariantRunner.grads``): rank ``r`` owns the chunk's
  token rows ``rows_r`` (``torch.tensor_split(range(C), TP)[r]``, maybe empty). Once per
  call an all-gather gives it the whole weight as ``[TP, Kmax * 256, Hg]`` per column
  group (rank ``s``'s shard rows, zero-padded to the most real blocks ``Kmax`` a rank
  holds; groups of ``Hg`` columns keep each under ``2**31`` elements, the weight's int32
  offsets: one group up to ``TP x Kmax 256 x H < 2**31``); per chunk an all-to-all gives
  it ``g[rows_r]`` of every rank as ``[TP, C / TP, Kmax * 256]`` (each rank's real blocks
  first, in order; ranks in vocab order); the ``k`` loop stops at ``Vreal``, so padding
  blocks are never read. A last all-gather of the ``[C / TP, H]`` row slices gives every
  rank the full ``d h``. Each element's ``k`` steps are TP 1's: the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops.block_stats import NUM_STAGES, NUM_WARPS
from mp_bridge.layers.loss.engines.triton_ops.tiles import FP_FUSION, INTERPRET, dot_acc

__all__ = ["BH", "BH_FP32", "BK", "BK_FP32", "TILE_M", "TILE_M_FP32", "dhidden", "out_tile"]

#: Output tile per program and vocab rows per ``k`` step, fixed per dtype (never tuned; a
#: row's bits do not depend on the tile, only on the ``k`` step and the MMA shape). bf16 /
#: fp16: 128 tokens x 256 hidden columns, one accumulator (``wgmma m64n256k16`` in both
#: builds; 167 / 240 registers, no spill; two ``[128, 128]`` halves spill in the odd
#: build), 64 rows per step; fp32 (FMA dot): 32 x 64, 32 rows per step.
TILE_M, BH, BK = 128, 256, 64
TILE_M_FP32, BH_FP32, BK_FP32 = 32, 64, 32
#: bf16 / fp16 token rows under ``TRITON_INTERPRET=1``: ``dot_acc``'s stand-in builds the
#: ``[TILE_M, BK, BH]`` products, which Triton caps at 2**20 elements (128 rows are 2**21);
#: the row tile moves no bit (each row is its own sum, ``k`` in order).
TILE_M_INTERPRET = 64


def out_tile(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(TILE_M, BH, BK)`` of ``d h`` for inputs of ``dtype``."""
    if dtype == torch.float32:
        return TILE_M_FP32, BH_FP32, BK_FP32
    return (TILE_M_INTERPRET if INTERPRET else TILE_M), BH, BK


@triton.jit
def _dhidden_kernel(
    g_ptr,
    g_piece,
    g_stride,
    w_ptr,
    w_piece,
    w_stride,
    out_ptr,
    out_stride,
    n_rows,
    hidden,
    k_rows,
    piece,
    w_rows,
    TILE_M: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < n_rows
    cmask = cols < hidden
    acc = tl.zeros((TILE_M, BH), tl.float32)
    # int64: the gathered g is C x V elements (2**31 at C = 8192, V = 262144)
    gp = g_ptr + rows.to(tl.int64)[:, None] * g_stride
    wp = w_ptr + cols[None, :]
    for v0 in range(0, k_rows, BK):  # the whole vocab, in order: one pipelined loop
        p = v0 // piece  # the piece (rank) holding global rows [v0, v0 + BK)
        ks = (v0 - p * piece) + tl.arange(0, BK)
        x = tl.load(gp + p.to(tl.int64) * g_piece + ks[None, :], mask=rmask[:, None], other=0.0)
        wmask = (ks < w_rows)[:, None] & cmask[None, :]
        y = tl.load(wp + p * w_piece + ks[:, None] * w_stride, mask=wmask, other=0.0)
        acc = dot_acc(x, y, acc, INTERPRET)
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, acc, mask=rmask[:, None] & cmask[None, :])


def dhidden(
    g: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    *,
    k_rows: int,
    w_rows: int | None = None,
) -> torch.Tensor:
    """``out [C, Hc] = g @ W`` over global vocab rows ``[0, k_rows)`` (fp32 ``out``, row
    stride free, unit column stride; see the module docstring).

    ``g``: ``[C, piece]`` or ``[P, C, piece]``; ``weight``: ``[rows, Hc]`` or ``[P, rows,
    Hc]`` (unit column stride), its rows past ``w_rows`` (default: all it has, at most
    ``piece``) per piece load as zeros. ``k_rows`` a multiple of ``VOCAB_BLOCK``, at most
    ``P * piece``."""
    g3 = g if g.dim() == 3 else g.unsqueeze(0)
    w3 = weight if weight.dim() == 3 else weight.unsqueeze(0)
    n, piece, hd = g3.shape[1], g3.shape[2], w3.shape[2]
    if k_rows % VOCAB_BLOCK or k_rows > g3.shape[0] * piece or piece % VOCAB_BLOCK:
        raise ValueError(f"d h: {k_rows} vocab rows in pieces of {piece} x {g3.shape[0]}")
    if g3.stride(2) != 1 or w3.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("d h: g, the weight and out need a unit column stride")
    rows_w = min(w3.shape[1], piece) if w_rows is None else w_rows
    if n == 0 or hd == 0:
        return out
    if k_rows == 0:
        return out.zero_()
    tm, bh, bk = out_tile(g.dtype)
    _dhidden_kernel[(triton.cdiv(n, tm), triton.cdiv(hd, bh))](
        g3, g3.stride(0), g3.stride(1), w3, w3.stride(0), w3.stride(1), out, out.stride(0),
        n, hd, k_rows, piece, rows_w, TILE_M=tm, BH=bh, BK=bk, INTERPRET=INTERPRET,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out
