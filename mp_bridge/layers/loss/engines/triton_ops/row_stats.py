"""Default mode, forward: per-row statistics of one vocab slab of fp32 logits, merged
into the running ones (one program per ``ROWS`` tokens, no atomics).

``z [N, Vs]``: the raw fp32 logits of weight rows ``[col0, col0 + Vs)`` of this shard
(a cuBLAS product, ``triton_ops.default``). Each program walks its rows' slab in ``COLS``-wide
tiles: ``transform`` (soft-cap, ``1 / T`` per row), ``tile_stats`` over the true columns
(local id ``< num_valid``), the online merge ``merge_stats2``; then, unless ``first``,
merges the statistics already in ``stats`` (the slabs before, in vocab order) and stores
``[S, N]`` in ``formulas.STATS`` order (``S`` = 4, + entropy's ``u``, + ``q``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    merge_stats2,
    stats_of,
    stats_params,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["COLS", "ROWS", "row_stats_"]

#: Tokens per program and vocab columns per tile step: a ``[4, 1024]`` fp32 tile is 16
#: values per thread over 8 warps (188 registers per thread at ``[8, 1024]``, sm_90 build:
#: one CTA per SM for a memory-bound pass); the row reductions stay inside one program.
ROWS = 4
COLS = 1024
NUM_WARPS = 8
NUM_STAGES = 3  # pinned (Triton's default today); no k-loop to pipeline


@triton.jit
def _row_stats_kernel(
    z_ptr,
    z_stride,
    stats_ptr,
    temp_ptr,
    tcol_ptr,
    n_rows,
    n_cols,
    col0,
    num_valid,
    cw_ptr,
    cap,
    HAS_CAP: tl.constexpr,
    WITH_ENT: tl.constexpr,
    HAS_CW: tl.constexpr,
    WITH_SQ: tl.constexpr,
    FIRST: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    t = tl.zeros((ROWS,), tl.float32)
    sz = tl.zeros((ROWS,), tl.float32)
    u = tl.zeros((ROWS,), tl.float32)
    q = tl.zeros((ROWS,), tl.float32)
    for v0 in range(0, n_cols, COLS):
        cols = v0 + tl.arange(0, COLS)
        inside = rmask[:, None] & (cols < n_cols)[None, :]
        x = tl.load(z_ptr + rows[:, None] * z_stride + cols[None, :], mask=inside, other=0.0)
        m2, s2, t2, z2, u2, q2 = stats_of(
            x, cols + col0, inside, rows, rmask, temp_ptr, tcol_ptr, cw_ptr, num_valid, cap,
            HAS_CAP, HAS_CW,
        )  # fmt: skip
        m, s, t, sz, u, q = merge_stats2(m, s, t, sz, u, q, m2, s2, t2, z2, u2, q2)
    if not FIRST:  # the slabs before this one lie left of it in vocab order
        m0 = tl.load(stats_ptr + rows, mask=rmask, other=float("-inf"))
        s0 = tl.load(stats_ptr + n_rows + rows, mask=rmask, other=0.0)
        t0 = tl.load(stats_ptr + 2 * n_rows + rows, mask=rmask, other=0.0)
        z0 = tl.load(stats_ptr + 3 * n_rows + rows, mask=rmask, other=0.0)
        u0 = tl.zeros((ROWS,), tl.float32)
        q0 = tl.zeros((ROWS,), tl.float32)
        if WITH_ENT:
            u0 = tl.load(stats_ptr + 4 * n_rows + rows, mask=rmask, other=0.0)
        if WITH_SQ:
            q0 = tl.load(stats_ptr + (4 + WITH_ENT) * n_rows + rows, mask=rmask, other=0.0)
        m, s, t, sz, u, q = merge_stats2(m0, s0, t0, z0, u0, q0, m, s, t, sz, u, q)
    tl.store(stats_ptr + rows, m, mask=rmask)
    tl.store(stats_ptr + n_rows + rows, s, mask=rmask)
    tl.store(stats_ptr + 2 * n_rows + rows, t, mask=rmask)
    tl.store(stats_ptr + 3 * n_rows + rows, sz, mask=rmask)
    if WITH_ENT:
        tl.store(stats_ptr + 4 * n_rows + rows, u, mask=rmask)
    if WITH_SQ:
        tl.store(stats_ptr + (4 + WITH_ENT) * n_rows + rows, q, mask=rmask)


def row_stats_(
    z: torch.Tensor,
    stats: torch.Tensor,
    temp: torch.Tensor,
    tcol: torch.Tensor,
    *,
    num_valid: int,
    col0: int,
    spec: LossSpec,
    first: bool,
    colw: torch.Tensor | None = None,
) -> None:
    """Merge the statistics of slab ``z [N, Vs]`` (fp32, unit column stride) into
    ``stats [S, N]`` (fp32, contiguous; written, not merged, when ``first``). ``colw``:
    the shard's fp32 column weights (by local id), with class weights."""
    n, vs = z.shape
    if n == 0:
        return
    args, flags = stats_params(spec, colw, temp)
    _row_stats_kernel[(triton.cdiv(n, ROWS),)](
        z, z.stride(0), stats, temp, tcol, n, vs, col0, num_valid, *args, **flags,
        FIRST=first, ROWS=ROWS, COLS=COLS, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
