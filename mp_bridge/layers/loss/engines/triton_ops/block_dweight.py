"""Invariant mode, backward step 3: ``d W += g^T h`` token tile by token tile, in token
order, each output element owned by one program (no split-K, no atomics).

Grid ``(ceil(R / BVW), ceil(H / BH))`` over the ``R`` real weight rows: program ``(v, c)``
loads its ``[BVW, BH]`` fp32 accumulator from ``acc`` (the sum of the earlier chunks),
adds ``g[tile]^T @ h[tile]`` for the chunk's ``TILE_M``-token tiles in order
(``dot_acc``, ``K = TILE_M``), and stores it back. Chunks start on whole tiles, so every
element gets the same adds in the same order whatever the chunking or the TP size; tokens
appended with zero upstream gradient add exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton_ops.block_dhidden import BH
from mp_bridge.layers.loss.engines.triton_ops.block_stats import NUM_STAGES, NUM_WARPS, TILE_M
from mp_bridge.layers.loss.engines.triton_ops.tiles import FP_FUSION, INTERPRET, dot_acc

__all__ = ["BVW", "block_dweight_"]

#: Weight rows per program (fixed: part of the bits).
BVW = 64


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
    vs = tl.program_id(0) * BVW + tl.arange(0, BVW)
    hcols = tl.program_id(1) * BH + tl.arange(0, BH)
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
    _block_dweight_kernel[(triton.cdiv(rows, BVW), triton.cdiv(hd, BH))](
        g,
        g.stride(0),
        h,
        h.stride(0),
        acc,
        n,
        hd,
        rows,
        TILE_M=TILE_M,
        BVW=BVW,
        BH=BH,
        INTERPRET=INTERPRET,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )
