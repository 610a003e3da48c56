"""Invariant mode, forward: per-(token tile, vocab block) statistics with the logits in
registers (the tile never reaches memory).

Grid ``(ceil(N / T), K)``, ``T = row_tile`` (bf16 / fp16: ``TILE_M = 128`` rows; fp32:
``TILE_M_FP32 = 32``), ``K`` the shard's real 256-row blocks: program ``(i, j)``
computes the ``[T, BLOCK]`` fp32 logits of tokens ``[i T, (i + 1) T)`` against local
block ``j`` (``block_logits``: ``k`` in ``BK`` steps, in order), ``transform``, then
``tile_stats`` over the block's true columns, and writes the block's ``[S]`` statistics
of each row to ``stats [S, K, N]``. bf16 / fp16 build the logits as two ``[128, 128]``
column halves and take the statistics of each (columns ``[0, 128)`` and ``[128, 256)``
of the block), merged left with right by ``merge_stats2``; fp32 takes them over the
whole ``[32, 256]`` tile. With any option that adds epilogue work (soft-cap, smoothing's
weighted sum, entropy, ``sum_pi_squared``: ``APART``) the two halves are computed one
after the other, each by its own ``k`` loop over the same hidden tile (one ``[128,
128]`` accumulator live at a time, the same MMA and ``k`` order, so the same bits): with
both accumulators live those epilogues spill (8 to 16 B); the price is the hidden tile
read twice from L2 (4 / 3 of the bytes per program, predicted). A row's statistics
depend on its own hidden row and the block's weight rows alone: not on ``N``, the tile
it shares, the chunk or the TP size. The engine then folds the ``K`` blocks in the
canonical tree (``fold_stats``; at TP > 1 on every rank's gathered statistics:
``reduce.gather_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    INTERPRET,
    block_logits,
    merge_stats2,
    stats_at,
    stats_params,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = [
    "BK",
    "BK_SPLIT",
    "NUM_STAGES",
    "NUM_WARPS",
    "STAGES_SPLIT",
    "TILE_M",
    "TILE_M_FP32",
    "ODD_STAGES_FP32",
    "aligned",
    "block_stats",
    "row_tile",
    "stats_build",
]

#: Fixed tiles, never autotuned: part of the invariant bits. ``row_tile(dtype)`` tokens x
#: one ``VOCAB_BLOCK`` of 256 ids per program, the hidden dim in steps of ``BK``. bf16 /
#: fp16: 128 rows as two ``[128, 128]`` column halves (``block_logits(..., SPLIT=True)``:
#: two accumulators sharing each loaded hidden tile, ``wgmma m64n128k16``, one warpgroup
#: per 64 rows), the statistics of each half (``stats_at``) merged left with right
#: (``merge_stats2``): no ``[128, 256]`` epilogue. fp32 (no tensor core, an FMA dot): 32
#: rows, one unsplit ``[32, 256]`` tile, since 64 spill. A row's bits do not depend on
#: the row tile (every element is its own row's dot, ``k`` in order); chunks are whole
#: ``row_tile`` tiles.
TILE_M = 128
TILE_M_FP32 = 32
#: ``k`` step of the fp32 statistics and of ``block_grad`` (every dtype).
BK = 32
#: ``k`` step and pipelining depth of the bf16 / fp16 statistics: with ``BK = 32`` the
#: odd (unvectorized) build spills at 128 rows; 16 (one ``k16`` MMA step per iteration:
#: the same MMA sequence on a GPU) spills in neither build, and 5 stages keep the loads
#: as far ahead (4 x 16 = 64 ``k``) as 3 stages of 32.
BK_SPLIT = 16
STAGES_SPLIT = 5
#: Tried (issue 42): ``k`` step 64 with 3 stages for the 16-divisible bf16 build. Compiled
#: for sm_90 it keeps the MMA (``m64n128k16``, four per step, in ``k`` order) and does not
#: spill in that build (statistics 255 registers, gradient 232; 145 KiB of shared memory
#: for 62 at ``k`` 16; one CTA per SM either way), but the odd build of the same wrapper
#: spills 688 B (statistics) and 112 B (gradient), so it would need a ``k`` step chosen by
#: alignment; the roofline has no term it improves, and the interpreter's stand-in dot
#: would sum 64 products per step (moving the CPU bits). Not kept; the GPU runbook
#: measures it.
NUM_WARPS = 8
#: Software-pipelining depth of every block kernel's k-loop (pinned, never Triton's
#: default; the bf16 / fp16 statistics: ``STAGES_SPLIT``).
NUM_STAGES = 3
#: fp32 builds without 16-divisible operands (unvectorized loads): 3 stages spill 24-32 B
#: in both the statistics and the gradient kernel; 2 do not (the loop then runs
#: unpipelined; the order of the FMAs, and so the bits, are the same).
ODD_STAGES_FP32 = 2


def row_tile(dtype: torch.dtype) -> int:
    """Token rows per program of the block kernels for inputs of ``dtype`` (fixed)."""
    return TILE_M_FP32 if dtype == torch.float32 else TILE_M


def aligned(*args) -> bool:
    """Whether every tensor's address and every integer is a multiple of 16 (the JIT's
    divisibility specialization: vectorized ``cp.async`` loads)."""
    return all((a.data_ptr() if hasattr(a, "data_ptr") else a) % 16 == 0 for a in args)


def stats_build(dtype: torch.dtype, is_aligned: bool = True) -> tuple[dict, int]:
    """The statistics kernel's fixed tile constexprs and pipelining depth for ``dtype``
    (``is_aligned``: the build's ``aligned`` operands; fp32 without them pipelines
    ``ODD_STAGES_FP32`` deep, the depth moving no bit)."""
    if dtype == torch.float32:
        return dict(TILE_M=TILE_M_FP32, BK=BK, SPLIT=False), (
            NUM_STAGES if is_aligned else ODD_STAGES_FP32
        )
    return dict(TILE_M=TILE_M, BK=BK_SPLIT, SPLIT=True), STAGES_SPLIT


@triton.jit
def _block_stats_kernel(
    h_ptr,
    h_stride,
    w_ptr,
    w_stride,
    stats_ptr,
    temp_ptr,
    tcol_ptr,
    n_rows,
    hidden,
    w_rows,
    n_blocks,
    num_valid,
    cw_ptr,
    cap,
    HAS_CAP: tl.constexpr,
    WITH_ENT: tl.constexpr,
    HAS_CW: tl.constexpr,
    WITH_SQ: tl.constexpr,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    APART: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    j = tl.program_id(1)
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    # SPLIT (bf16 / fp16): two [TILE_M, BLOCK / 2] accumulators, statistics per half;
    # APART: the halves one after the other (two k-loops, one accumulator live at a time)
    HALF: tl.constexpr = BLOCK // 2 if SPLIT else BLOCK
    cols = j * BLOCK + tl.arange(0, HALF)
    rmask = rows < n_rows
    if APART:
        xa, _ = block_logits(
            h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols, w_rows, hidden,
            TILE_M, HALF, BK, INTERPRET, False,
        )  # fmt: skip
    else:
        xa, xb = block_logits(
            h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols, w_rows, hidden,
            TILE_M, BLOCK, BK, INTERPRET, SPLIT,
        )  # fmt: skip
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    # int32 (a local id or -1): the per-element target compares in 32 bits, fewer registers
    tcol = tl.load(tcol_ptr + rows, mask=rmask, other=-1).to(tl.int32)
    m, s, t, sz, u, q = stats_at(
        xa, cols, rmask[:, None], temp, tcol, cw_ptr, num_valid, cap, HAS_CAP, HAS_CW
    )
    if SPLIT:  # the right half's statistics, merged into the left's (left, right)
        if APART:
            xb, _ = block_logits(
                h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols + HALF, w_rows, hidden,
                TILE_M, HALF, BK, INTERPRET, False,
            )  # fmt: skip
        m2, s2, t2, sz2, u2, q2 = stats_at(
            xb, cols + HALF, rmask[:, None], temp, tcol, cw_ptr, num_valid, cap, HAS_CAP,
            HAS_CW,
        )  # fmt: skip
        m, s, t, sz, u, q = merge_stats2(m, s, t, sz, u, q, m2, s2, t2, sz2, u2, q2)
    out = stats_ptr + j * n_rows + rows
    plane = n_blocks * n_rows
    tl.store(out, m, mask=rmask)
    tl.store(out + plane, s, mask=rmask)
    tl.store(out + 2 * plane, t, mask=rmask)
    tl.store(out + 3 * plane, sz, mask=rmask)
    if WITH_ENT:
        tl.store(out + 4 * plane, u, mask=rmask)
    if WITH_SQ:
        tl.store(out + (4 + WITH_ENT) * plane, q, mask=rmask)


def block_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    temp: torch.Tensor,
    tcol: torch.Tensor,
    *,
    n_blocks: int,
    num_valid: int,
    spec: LossSpec,
    colw: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[S, K, N]`` fp32 per-block statistics of ``h [N, H]`` against the first ``K =
    n_blocks`` blocks of ``weight [V_local, H]`` (rows past ``V_local`` are zeros).
    ``colw``: the shard's fp32 column weights (by local id), with class weights."""
    n, hd = h.shape
    stats = torch.empty((spec.num_stats, n_blocks, n), dtype=torch.float32, device=h.device)
    if n == 0 or n_blocks == 0:
        return stats
    args, flags = stats_params(spec, colw, temp)
    tiles, stages = stats_build(
        h.dtype, aligned(h, weight, stats, n, hd, weight.shape[0], h.stride(0), weight.stride(0))
    )
    tiles["APART"] = tiles["SPLIT"] and any(flags.values())
    _block_stats_kernel[(triton.cdiv(n, tiles["TILE_M"]), n_blocks)](
        h, h.stride(0), weight, weight.stride(0), stats, temp, tcol, n, hd, weight.shape[0],
        n_blocks, num_valid, *args, **flags, **tiles, BLOCK=VOCAB_BLOCK, INTERPRET=INTERPRET,
        num_warps=NUM_WARPS, num_stages=stages, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return stats
