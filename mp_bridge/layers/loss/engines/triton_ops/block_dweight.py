"""Invariant mode, backward step 3: ``d W += g^T h`` token tile by token tile, in token
order, each output element owned by one program (no split-K, no atomics).

Grid ``(ceil(H / BH), ceil(R / BVW))`` over the ``R`` real weight rows, hidden tiles
fastest (the grid order moves no bit): the programs in flight share one ``g[:, v-tile]``
slice, read from HBM once per chunk, and stream the chunk's ``h`` from L2. Program ``(c,
v)`` loads its ``[BVW, BH]`` fp32 accumulator from ``acc`` (the sum of the earlier
chunks), adds ``g[tile]^T @ h[tile]`` for the chunk's ``TILE_K``-token tiles in order
(``dot_acc``, ``K = TILE_K``), and stores it back. Chunks start on whole tiles, so every
element gets the same adds in the same order whatever the chunking or the TP size; tokens
appended with zero upstream gradient add exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton_ops.block_stats import NUM_STAGES, NUM_WARPS
from mp_bridge.layers.loss.engines.triton_ops.tiles import FP_FUSION, INTERPRET, dot_acc

__all__ = ["BH", "BH_FP32", "BVW", "BVW_FP32", "TILE_K", "block_dweight_", "out_tile"]

#: Tokens per product step (``K`` of each ``dot_acc``; fixed: part of the bits, and a
#: divisor of the chunk, a whole number of ``block_stats.TILE_M``).
TILE_K = 32
#: Output tile ``[BVW, BH]`` per program, fixed per dtype (each element is one program's
#: own sum, so the tile moves no bit of it; it sets the traffic: ``BVW BH / (BVW + BH)``
#: FLOP per streamed byte). bf16 / fp16: 128 x 128 (``wgmma m64n128k16``, no spill in
#: either build); fp32 (FMA dot): 64 x 64.
BVW, BH = 128, 128
BVW_FP32, BH_FP32 = 64, 64


def out_tile(dtype: torch.dtype) -> tuple[int, int]:
    """``(BVW, BH)`` of ``d W`` for inputs of ``dtype``."""
    return (BVW_FP32, BH_FP32) if dtype == torch.float32 else (BVW, BH)


@triton.jit
def _block_dweight_kernel(
    g_ptr,
    g_stride,
    h_ptr,
    h_stride,
    acc_ptr,
    n_rows,
    hidden,
    v_rows,
    TILE_M: tl.constexpr,
    BVW: tl.constexpr,
    BH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    hcols = tl.program_id(0) * BH + tl.arange(0, BH)
    vs = tl.program_id(1) * BVW + tl.arange(0, BVW)
    vmask = vs < v_rows
    hmask = hcols < hidden
    out = acc_ptr + vs[:, None] * hidden + hcols[None, :]
    omask = vmask[:, None] & hmask[None, :]
    acc = tl.load(out, mask=omask, other=0.0)
    for m0 in range(0, n_rows, TILE_M):
        ms = m0 + tl.arange(0, TILE_M)
        mmask = ms < n_rows
        gt = tl.load(
            g_ptr + ms[None, :] * g_stride + vs[:, None],
            mask=mmask[None, :] & vmask[:, None],
            other=0.0,
        )  # [BVW, TILE_M]: g^T
        ht = tl.load(
            h_ptr + ms[:, None] * h_stride + hcols[None, :],
            mask=mmask[:, None] & hmask[None, :],
            other=0.0,
        )
        acc = dot_acc(gt, ht, acc, INTERPRET)
    tl.store(out, acc, mask=omask)


def block_dweight_(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``acc [R, H] += g[:, :R]^T @ h`` (fp32 ``acc``, contiguous; ``g [C, >= R]``,
    ``h [C, H]``)."""
    n, hd = h.shape
    rows = acc.shape[0]
    if n == 0 or rows == 0:
        return
    bvw, bh = out_tile(h.dtype)
    _block_dweight_kernel[(triton.cdiv(hd, bh), triton.cdiv(rows, bvw))](
        g,
        g.stride(0),
        h,
        h.stride(0),
        acc,
        n,
        hd,
        rows,
        TILE_M=TILE_K,
        BVW=bvw,
        BH=bh,
        INTERPRET=INTERPRET,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )
