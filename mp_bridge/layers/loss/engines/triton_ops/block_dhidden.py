"""Invariant mode, backward step 2: ``d h`` as per-block products folded in the canonical
block tree, inside the kernel, with no atomics.

Grid ``(ceil(C / TILE_M), ceil(H / BH))``: program ``(i, c)`` walks this rank's real
blocks ``j = first, first + 1, ...`` (global indices) in order; block ``j``'s part is
``g[tile, block j] @ W[block j, h-slice c]`` (``dot_acc`` over the block's 256 rows in
``BKV`` steps, in order; one k-loop over all blocks' steps, so the software pipeline runs
across leaves, a leaf's tree step after its last step), pushed onto a stack of partial
sums that the program keeps in its own slice of ``scratch [D, C, H]`` fp32. The lowest
level stays on chip: a leaf that starts an aligned pair whose right leaf is also this
rank's is held in registers and added (left + right, the stack's own expression and
bits) when the right one is done; only the pair's sum is pushed. After pushing node
``j``, the top two nodes merge (left + right) while the node ending at ``j + 1`` at the
next level up is an aligned subtree that starts at or after ``first``: exactly
``tree.StreamFold``, so the stack ends holding this rank's maximal aligned subtrees
(``BlockLayout.pieces``), each the sum its subtree has in the canonical tree.
``reduce.gather_fold`` then gathers the pieces of all ranks and folds them in tree
order: the expression TP = 1 evaluates, for every block-aligned TP size. A row's bits
depend on its own ``g`` row alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops.block_stats import NUM_STAGES, NUM_WARPS, row_tile
from mp_bridge.layers.loss.engines.triton_ops.tiles import FP_FUSION, INTERPRET, dot_acc

__all__ = ["BH", "BKV", "TILE_M", "block_dhidden", "stack_depth"]

#: Hidden columns per program and block rows per product step (fixed: part of the bits).
BH = 64
BKV = 32
#: Token rows per program for bf16 / fp16 (``wgmma m64n64k16``: per token, 128 rows stream
#: half the ``W`` bytes of 64; no spill in either build); fp32 takes
#: ``block_stats.row_tile``. A row's bits do not depend on it (its own ``g`` row alone).
TILE_M = 128


@triton.jit
def _block_dhidden_kernel(
    g_ptr,
    g_stride,
    w_ptr,
    w_stride,
    scratch_ptr,
    n_rows,
    hidden,
    w_rows,
    n_blocks,
    first,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BH: tl.constexpr,
    BKV: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    hcols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < n_rows
    hmask = hcols < hidden
    tile = rows[:, None] * hidden + hcols[None, :]
    tmask = rmask[:, None] & hmask[None, :]
    plane = n_rows * hidden
    zero = tl.program_id(0) * 0  # an int32 tensor: the loop-carried counters' type
    sp = zero
    held = tl.zeros((TILE_M, BH), tl.float32)  # the left leaf of an aligned pair
    part = tl.zeros((TILE_M, BH), tl.float32)
    steps: tl.constexpr = BLOCK // BKV
    for t in range(0, n_blocks * steps):  # one loop over every block's steps: one pipeline
        vs = t * BKV + tl.arange(0, BKV)  # block t // steps, rows in BKV steps, in order
        gt = tl.load(g_ptr + rows[:, None] * g_stride + vs[None, :], mask=rmask[:, None], other=0.0)
        wt = tl.load(
            w_ptr + vs[:, None] * w_stride + hcols[None, :],
            mask=(vs < w_rows)[:, None] & hmask[None, :],
            other=0.0,
        )
        part = dot_acc(gt, wt, part, INTERPRET)
        if t % steps == steps - 1:  # leaf jj done
            jj = t // steps
            end = first + jj + 1  # the leaf ends here (global block index)
            if (end % 2 == 1) & (jj + 1 < n_blocks):
                held = part  # its right sibling is this rank's next leaf: stays on chip
            else:
                level = zero + 1
                if (end % 2 == 0) & (jj >= 1):  # the right leaf of a held pair
                    part = held + part
                    level += 1
                while (end % (1 << level) == 0) & (end - (1 << level) >= first):
                    sp -= 1
                    part = tl.load(scratch_ptr + sp * plane + tile, mask=tmask, other=0.0) + part
                    level += 1
                tl.store(scratch_ptr + sp * plane + tile, part, mask=tmask)
                sp += 1
            part = tl.zeros((TILE_M, BH), tl.float32)


def stack_depth(n_blocks: int) -> int:
    """Most nodes the stack holds while folding ``n_blocks`` consecutive leaves."""
    return max(1, n_blocks.bit_length()) + 1


def block_dhidden(
    g: torch.Tensor, weight: torch.Tensor, *, n_blocks: int, first: int
) -> torch.Tensor:
    """``scratch [D, C, H]`` fp32 whose first ``len(pieces)`` planes are this rank's
    subtree sums of ``d h`` for ``g [C, K * BLOCK]`` (``K = n_blocks``, global block
    index of local block 0: ``first``)."""
    n, hd = g.shape[0], weight.shape[1]
    scratch = torch.empty((stack_depth(n_blocks), n, hd), dtype=torch.float32, device=g.device)
    if n == 0 or n_blocks == 0:
        return scratch
    tm = row_tile(g.dtype) if g.dtype == torch.float32 else TILE_M
    _block_dhidden_kernel[(triton.cdiv(n, tm), triton.cdiv(hd, BH))](
        g,
        g.stride(0),
        weight,
        weight.stride(0),
        scratch,
        n,
        hd,
        weight.shape[0],
        n_blocks,
        first,
        TILE_M=tm,
        BLOCK=VOCAB_BLOCK,
        BH=BH,
        BKV=BKV,
        INTERPRET=INTERPRET,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )
    return scratch
