"""Invariant mode, backward step 3: ``d W += g^T h`` token tile by token tile, in token
order, each output element owned by one program (no split-K, no atomics).

A 1-D grid of ``ceil(H / BH) x ceil(R / BVW)`` programs over the ``R`` real weight rows,
in groups of ``GROUP_V`` vocab tiles (the launch order moves no bit): ``g[:, v-tile]`` is
read from HBM once per chunk and ``h[:, c-tile]`` once per group. Program ``(c, v)``
loads its ``[BVW, BH]`` fp32 accumulator from ``out`` (the sum of the earlier
chunks; an ``accumulator``) as two ``[BVW, BH / 2]`` halves, adds ``g[tile]^T @
h[tile]`` for the chunk's ``TILE_K``-token tiles in order (``dot_acc``, ``K = TILE_K``;
both halves share the loaded ``g^T`` tile), and stores it back. Chunks start on whole
tiles, so every element gets the same adds in the same order whatever the chunking or the
TP size; tokens appended with zero upstream gradient add exact zeros.

``fresh`` (the whole token range is one chunk): the sum starts at zero instead of a
loaded accumulator (the same ``+0.0`` the zeroed accumulator holds) and is stored rounded
to nearest even straight into ``d W`` in the weight's dtype (``tiles.rounded``, the
conversion ``acc.to(dtype)`` makes): no fp32 ``[R, H]`` and no copy, the same bits as
the multi-chunk path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton_ops.block_stats import NUM_STAGES, NUM_WARPS
from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    INTERPRET,
    dot_acc,
    rounded,
)

__all__ = [
    "ACC_ALIGN",
    "BH",
    "BH_FP32",
    "BVW",
    "BVW_FP32",
    "GROUP_V",
    "TILE_K",
    "accumulator",
    "block_dweight_",
    "out_tile",
]

#: Tokens per product step (``K`` of each ``dot_acc``; fixed: part of the bits, and a
#: divisor of the chunk: ``triton_ops.invariant`` rounds chunks to whole multiples of it and
#: of ``block_stats.TILE_M``).
TILE_K = 64
#: Output tile ``[BVW, BH]`` per program, fixed per dtype (each element is one program's
#: own sum, so the tile moves no bit of it; it sets the traffic: ``BVW BH / (BVW + BH)``
#: FLOP per streamed byte). bf16 / fp16: 128 x 256 as two 128 x 128 accumulators (``wgmma
#: m64n128k16``; one 128 x 256 accumulator, ``m64n256k16``, spills in the odd-``H``
#: build), 3 stages of 48 KiB; fp32 (FMA dot): 64 x 64 (two 64 x 32 halves).
BVW, BH = 128, 256
BVW_FP32, BH_FP32 = 64, 64
#: Vocab tiles per group of the launch order: program ``p`` of a group takes vocab tile
#: ``p % GROUP_V`` and hidden tile ``p // GROUP_V``, so each ``h[:, c-tile]`` is read once
#: per group (its ``GROUP_V`` users run back to back) and each ``g[:, v-tile]`` once per
#: chunk (its users sit within one group: ``GROUP_V`` ``g`` slices and one ``h`` slice in
#: between, 20 MB at ``C = 8192``, bf16). Hidden tiles fastest instead re-read the whole
#: ``h`` chunk per vocab tile once it outgrows L2 (64 MB at ``C = 8192``, ``H = 4096``).
GROUP_V = 8
#: Row stride of the fp32 accumulator, in elements, rounded up to a multiple of this
#: (``accumulator``): the kernel's accumulator loads and stores vectorize whatever ``H``
#: (an odd row stride spills the 128 x 256 tile's address registers).
ACC_ALIGN = 16


def out_tile(dtype: torch.dtype) -> tuple[int, int]:
    """``(BVW, BH)`` of ``d W`` for inputs of ``dtype``."""
    return (BVW_FP32, BH_FP32) if dtype == torch.float32 else (BVW, BH)


def accumulator(rows: int, hidden: int, device) -> torch.Tensor:
    """A zeroed fp32 ``[rows, hidden]`` accumulator for ``block_dweight_``, its row stride
    rounded up to ``ACC_ALIGN`` elements (a view of ``[rows, stride]``; contiguous when
    ``hidden`` is a multiple of ``ACC_ALIGN``)."""
    stride = -(-hidden // ACC_ALIGN) * ACC_ALIGN
    return torch.zeros((rows, stride), dtype=torch.float32, device=device)[:, :hidden]


@triton.jit
def _block_dweight_kernel(
    g_ptr,
    g_stride,
    h_ptr,
    h_stride,
    out_ptr,
    out_stride,
    n_rows,
    hidden,
    v_rows,
    TILE_M: tl.constexpr,
    BVW: tl.constexpr,
    BH: tl.constexpr,
    ADD: tl.constexpr,
    GROUP_V: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    HALF: tl.constexpr = BH // 2
    # grouped launch order: GROUP_V vocab tiles fastest, then the hidden tiles, group by
    # group (``GROUP_V``); no bit depends on it
    pid = tl.program_id(0)
    n_v = tl.cdiv(v_rows, BVW)
    per_group = GROUP_V * tl.cdiv(hidden, BH)
    first_v = (pid // per_group) * GROUP_V
    size = tl.minimum(n_v - first_v, GROUP_V)
    ha = ((pid % per_group) // size) * BH + tl.arange(0, HALF)
    hb = ha + HALF
    vs = (first_v + (pid % per_group) % size) * BVW + tl.arange(0, BVW)
    vmask = vs < v_rows
    amask = vmask[:, None] & (ha < hidden)[None, :]
    bmask = vmask[:, None] & (hb < hidden)[None, :]
    out_a = out_ptr + vs[:, None] * out_stride + ha[None, :]
    out_b = out_ptr + vs[:, None] * out_stride + hb[None, :]
    if ADD:  # the fp32 sum of the earlier chunks
        acc_a = tl.load(out_a, mask=amask, other=0.0)
        acc_b = tl.load(out_b, mask=bmask, other=0.0)
    else:
        acc_a = tl.zeros((BVW, HALF), tl.float32)
        acc_b = tl.zeros((BVW, HALF), tl.float32)
    for m0 in range(0, n_rows, TILE_M):
        ms = m0 + tl.arange(0, TILE_M)
        mmask = ms < n_rows
        gt = tl.load(
            g_ptr + ms[None, :] * g_stride + vs[:, None],
            mask=mmask[None, :] & vmask[:, None],
            other=0.0,
        )  # [BVW, TILE_M]: g^T
        hp = h_ptr + ms[:, None] * h_stride
        ht_a = tl.load(hp + ha[None, :], mask=mmask[:, None] & (ha < hidden)[None, :], other=0.0)
        ht_b = tl.load(hp + hb[None, :], mask=mmask[:, None] & (hb < hidden)[None, :], other=0.0)
        acc_a = dot_acc(gt, ht_a, acc_a, INTERPRET)
        acc_b = dot_acc(gt, ht_b, acc_b, INTERPRET)
    tl.store(out_a, rounded(acc_a, out_ptr, INTERPRET), mask=amask)
    tl.store(out_b, rounded(acc_b, out_ptr, INTERPRET), mask=bmask)


def block_dweight_(
    out: torch.Tensor, g: torch.Tensor, h: torch.Tensor, fresh: bool = False
) -> None:
    """``out [R, H] += g[:, :R]^T @ h`` (``g [C, >= R]``, ``h [C, H]``; ``out``: an fp32
    ``accumulator``, unit column stride). ``fresh``: ``out = g[:, :R]^T @ h`` rounded to
    ``out``'s dtype (any float dtype), the whole token range in this one call."""
    n, hd = h.shape
    rows = out.shape[0]
    if rows == 0:
        return
    if n == 0:
        if fresh:
            out.zero_()
        return
    assert out.stride(1) == 1 and (fresh or out.dtype == torch.float32), (out.dtype, fresh)
    bvw, bh = out_tile(h.dtype)
    _block_dweight_kernel[(triton.cdiv(hd, bh) * triton.cdiv(rows, bvw),)](
        g,
        g.stride(0),
        h,
        h.stride(0),
        out,
        out.stride(0),
        n,
        hd,
        rows,
        TILE_M=TILE_K,
        BVW=bvw,
        BH=bh,
        ADD=not fresh,
        GROUP_V=GROUP_V,
        INTERPRET=INTERPRET,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )
