"""Invariant mode, forward: per-(token tile, vocab block) statistics with the logits in
registers (the tile never reaches memory).

Grid ``(ceil(N / TILE_M), K)``, ``K`` the shard's real 256-row blocks: program ``(i, j)``
computes the ``[TILE_M, BLOCK]`` fp32 logits of tokens ``[i TILE_M, (i + 1) TILE_M)``
against local block ``j`` (``block_logits``: ``k`` in ``BK`` steps, in order),
``transform``, then ``tile_stats`` over the block's true columns, and writes the
block's ``[S]`` statistics of each row to ``stats [S, K, N]``. A row's statistics depend
on its own hidden row and the block's weight rows alone: not on ``N``, the tile it shares,
the chunk or the TP size. The engine then folds the ``K`` blocks in the canonical tree
(``blocks.fold_blocks``, ``reduce.gather_fold``).
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
    stats_of,
    stats_params,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["BK", "NUM_STAGES", "NUM_WARPS", "TILE_M", "TILE_M_FP32", "block_stats", "row_tile"]

#: Fixed tiles, never autotuned: part of the invariant bits. ``row_tile(dtype)`` tokens x
#: one ``VOCAB_BLOCK`` of 256 ids per program, the hidden dim in steps of ``BK``. bf16 /
#: fp16: 64 rows, the smallest tile Triton lowers to ``wgmma`` (sm_90: ``m64n128k16``,
#: one warpgroup per 128 columns; 32 rows lower to Ampere's ``mma.sync``); 128 rows spill
#: the ``[128, 256]`` accumulator plus the statistics epilogue. fp32 (no tensor core, an
#: FMA dot): 32 rows, since 64 spill. A row's bits do not depend on the row tile (every
#: element is its own row's dot, ``k`` in order); chunks are whole ``TILE_M`` tiles.
TILE_M = 64
TILE_M_FP32 = 32
BK = 32
NUM_WARPS = 8
#: Software-pipelining depth of every block kernel's k-loop (pinned, never Triton's default).
NUM_STAGES = 3


def row_tile(dtype: torch.dtype) -> int:
    """Token rows per program of the block kernels for inputs of ``dtype`` (fixed)."""
    return TILE_M_FP32 if dtype == torch.float32 else TILE_M


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
    INTERPRET: tl.constexpr,
):
    j = tl.program_id(1)
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < n_rows
    x, _ = block_logits(
        h_ptr, h_stride, w_ptr, w_stride, rows, rmask, cols, w_rows, hidden,
        TILE_M, BLOCK, BK, INTERPRET, False,
    )  # fmt: skip
    m, s, t, sz, u, q = stats_of(
        x, cols, rmask[:, None], rows, rmask, temp_ptr, tcol_ptr, cw_ptr, num_valid, cap,
        HAS_CAP, HAS_CW,
    )  # fmt: skip
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
    tm = row_tile(h.dtype)
    _block_stats_kernel[(triton.cdiv(n, tm), n_blocks)](
        h, h.stride(0), weight, weight.stride(0), stats, temp, tcol, n, hd, weight.shape[0],
        n_blocks, num_valid, *args, **flags, TILE_M=tm, BLOCK=VOCAB_BLOCK, BK=BK,
        INTERPRET=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return stats
