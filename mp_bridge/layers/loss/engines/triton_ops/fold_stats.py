"""Invariant mode, forward: the canonical tree's root of all ``K`` blocks' statistics in
one launch (no tensor core: element-wise in the tokens).

Input: the per-block statistics ``[S, K, C]`` fp32 of ``block_stats`` for ALL ``K`` real
blocks in global block order, or the all-gathered ``[R, S, K_r, C]`` of ``R`` ranks
holding ``K_r`` blocks each (rank ``r``'s local block ``j`` is global block ``r K_r + j``;
only global blocks below ``K`` are read, so a rank's padding slots may hold anything).
Output: ``[S, C]``, the root of ``tree``'s canonical tree over the ``K`` leaves, merged by
``tiles.merge_stats2`` (``formulas.merge_stats``: one formula for every ``LossSpec``; the
planes ``m, s, t, sz`` then ``u`` with ``WITH_ENT`` then ``q`` with ``WITH_SQ``).

Grid ``ceil(C / TILE_N)``: program ``i`` folds token columns ``[i TILE_N, (i + 1) TILE_N)``
alone. One *pass* folds every aligned group of ``FAN = 16`` nodes of the level below it
in registers (four tree levels: ``_fold4`` of four ``_fold4``); a node whose first leaf is
at or past ``K`` is the identity and its left sibling is carried up unchanged
(``tl.where``, not merged), exactly ``tree.fold_tree``'s rule, so ``n`` nodes become
``ceil(n / 16)``, i.e. four canonical levels. Pass 1 reads the input and writes node
``i`` to ``scratch [S, ceil(K / 16), C]``; later passes fold ``scratch`` in place (group
``i`` reads nodes ``[16 i, 16 i + 16)`` and writes node ``i <= 16 i``: no later group reads
it); the root ends in ``scratch[:, 0]``. ``K = 1``: pass 1 copies the leaf.

Every merge has one fixed pair of operands, whatever the TP size, the rank layout of the
input, the token count or ``TILE_N``: the bits of a column depend on its ``K`` leaves
alone (fp32, no FMA contraction: ``tiles.FP_FUSION``). HBM: the input read once, the
scratch about ``1 / 15`` of it written and read back, the root written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton_ops.tiles import FP_FUSION, merge_stats2
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["FAN", "NUM_STAGES", "NUM_WARPS", "TILE_N", "fold_passes", "fold_stats"]

#: Token columns per program (one fp32 element of each statistic per thread at 2 warps);
#: the bits do not depend on it (element-wise). 64 keeps ``C / 64`` programs (128 at
#: ``FOLD_TOKENS = 8192``) for the 132 SMs of an H200.
TILE_N = 64
NUM_WARPS = 2
#: No software pipelining: each pass's loads come after the previous pass's stores.
NUM_STAGES = 1
#: Nodes one pass folds in registers (four tree levels; ``_fold16``).
FAN = 16


def fold_passes(num_real: int) -> int:
    """Passes of ``FAN`` nodes from ``num_real`` leaves to the root (at least one)."""
    passes, n = 1, -(-num_real // FAN)
    while n > 1:
        passes, n = passes + 1, -(-n // FAN)
    return passes


@triton.jit
def _load(ptr, plane, cols, mask, WITH_ENT: tl.constexpr, WITH_SQ: tl.constexpr):
    """One node's ``(m, s, t, sz, u, q)`` at ``ptr + cols`` (planes ``plane`` apart; ``u``
    / ``q`` zeros without their flag); the identity where ``mask`` is false."""
    p = ptr + cols
    m = tl.load(p, mask=mask, other=float("-inf"))
    s = tl.load(p + plane, mask=mask, other=0.0)
    t = tl.load(p + 2 * plane, mask=mask, other=0.0)
    sz = tl.load(p + 3 * plane, mask=mask, other=0.0)
    u = tl.zeros_like(s)
    q = tl.zeros_like(s)
    if WITH_ENT:
        u = tl.load(p + 4 * plane, mask=mask, other=0.0)
    if WITH_SQ:
        q = tl.load(p + (4 + WITH_ENT) * plane, mask=mask, other=0.0)
    return m, s, t, sz, u, q


@triton.jit
def _store(ptr, plane, cols, mask, x, WITH_ENT: tl.constexpr, WITH_SQ: tl.constexpr):
    p = ptr + cols
    tl.store(p, x[0], mask=mask)
    tl.store(p + plane, x[1], mask=mask)
    tl.store(p + 2 * plane, x[2], mask=mask)
    tl.store(p + 3 * plane, x[3], mask=mask)
    if WITH_ENT:
        tl.store(p + 4 * plane, x[4], mask=mask)
    if WITH_SQ:
        tl.store(p + (4 + WITH_ENT) * plane, x[5], mask=mask)


@triton.jit
def _pair(a, b, b_real):
    """The parent of sibling nodes ``a`` (left, real) and ``b``: their merge, or ``a``
    itself (every bit) when ``b`` is the identity (``b_real`` false: carried up)."""
    m, s, t, sz, u, q = merge_stats2(
        a[0], a[1], a[2], a[3], a[4], a[5], b[0], b[1], b[2], b[3], b[4], b[5]
    )  # fmt: skip
    return (
        tl.where(b_real, m, a[0]),
        tl.where(b_real, s, a[1]),
        tl.where(b_real, t, a[2]),
        tl.where(b_real, sz, a[3]),
        tl.where(b_real, u, a[4]),
        tl.where(b_real, q, a[5]),
    )


@triton.jit
def _node(ptr, plane, rank_stride, per_rank, n_cols, k, n, cols, cmask,
          WITH_ENT: tl.constexpr, WITH_SQ: tl.constexpr):  # fmt: skip
    """Node ``k`` of ``n`` (the identity when ``k >= n``): at ``ptr + (k // per_rank)
    rank_stride + (k % per_rank) n_cols``."""
    at = ptr + (k // per_rank) * rank_stride + (k % per_rank) * n_cols
    return _load(at, plane, cols, cmask & (cols * 0 + k < n), WITH_ENT, WITH_SQ)


@triton.jit
def _fold4(ptr, plane, rank_stride, per_rank, n_cols, k, n, cols, cmask,
           WITH_ENT: tl.constexpr, WITH_SQ: tl.constexpr):  # fmt: skip
    """The subtree of nodes ``[k, k + 4)`` of ``n`` (``k`` a multiple of 4)."""
    a = _node(ptr, plane, rank_stride, per_rank, n_cols, k, n, cols, cmask, WITH_ENT, WITH_SQ)
    b = _node(ptr, plane, rank_stride, per_rank, n_cols, k + 1, n, cols, cmask, WITH_ENT, WITH_SQ)
    c = _node(ptr, plane, rank_stride, per_rank, n_cols, k + 2, n, cols, cmask, WITH_ENT, WITH_SQ)
    d = _node(ptr, plane, rank_stride, per_rank, n_cols, k + 3, n, cols, cmask, WITH_ENT, WITH_SQ)
    return _pair(_pair(a, b, k + 1 < n), _pair(c, d, k + 3 < n), k + 2 < n)


@triton.jit
def _fold16(ptr, plane, rank_stride, per_rank, n_cols, k, n, cols, cmask,
            WITH_ENT: tl.constexpr, WITH_SQ: tl.constexpr):  # fmt: skip
    """The subtree of nodes ``[k, k + 16)`` of ``n`` (``k`` a multiple of 16, ``k < n``):
    four levels, each quarter's root real iff its first node is (a quarter past ``n``
    loads nothing: every load is masked; its merges are discarded)."""
    a = _fold4(ptr, plane, rank_stride, per_rank, n_cols, k, n, cols, cmask, WITH_ENT, WITH_SQ)
    b = _fold4(ptr, plane, rank_stride, per_rank, n_cols, k + 4, n, cols, cmask,
               WITH_ENT, WITH_SQ)  # fmt: skip
    c = _fold4(ptr, plane, rank_stride, per_rank, n_cols, k + 8, n, cols, cmask,
               WITH_ENT, WITH_SQ)  # fmt: skip
    d = _fold4(ptr, plane, rank_stride, per_rank, n_cols, k + 12, n, cols, cmask,
               WITH_ENT, WITH_SQ)  # fmt: skip
    return _pair(_pair(a, b, k + 4 < n), _pair(c, d, k + 12 < n), k + 8 < n)


@triton.jit(do_not_specialize=["n_leaves", "n_passes"])
def _fold_stats_kernel(
    x_ptr,
    x_plane,
    x_rank,
    per_rank,
    sc_ptr,
    sc_plane,
    n_cols,
    n_leaves,
    n_passes,
    WITH_ENT: tl.constexpr,
    WITH_SQ: tl.constexpr,
    TILE_N: tl.constexpr,
):
    cols = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    cmask = cols < n_cols
    n = n_leaves
    for i in range(0, (n + 15) // 16):  # pass 1: the leaves (rank-major input) -> scratch
        r = _fold16(x_ptr, x_plane, x_rank, per_rank, n_cols, 16 * i, n, cols, cmask,
                    WITH_ENT, WITH_SQ)  # fmt: skip
        _store(sc_ptr + i * n_cols, sc_plane, cols, cmask, r, WITH_ENT, WITH_SQ)
    n = (n + 15) // 16
    for _ in range(1, n_passes):  # later passes: scratch in place
        tl.debug_barrier()
        for i in range(0, (n + 15) // 16):
            r = _fold16(sc_ptr, sc_plane, 0, n, n_cols, 16 * i, n, cols, cmask,
                        WITH_ENT, WITH_SQ)  # fmt: skip
            _store(sc_ptr + i * n_cols, sc_plane, cols, cmask, r, WITH_ENT, WITH_SQ)
        n = (n + 15) // 16


def fold_stats(stats: torch.Tensor, spec: LossSpec, num_real: int | None = None) -> torch.Tensor:
    """The canonical tree's root ``[S, C]`` fp32 of the per-block statistics ``stats``.

    ``stats``: contiguous fp32 ``[S, K, C]`` (the ``K`` real blocks in global order), or
    ``[R, S, K_r, C]`` gathered in rank order with ``num_real`` real blocks in all (rank
    ``r``'s real blocks first in its slot, every rank before the last holding ``K_r``).
    Returns a view ``[S, C]`` (row stride ``ceil(K / 16) C``) of the kernel's scratch.
    """
    if stats.dim() == 3:
        stats = stats.unsqueeze(0)
    r, s, per, c = stats.shape
    k = per * r if num_real is None else num_real
    if s != spec.num_stats or not 1 <= k <= per * r:
        raise ValueError(f"stats {tuple(stats.shape)} for {k} blocks of S={spec.num_stats}")
    if stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError("fold_stats needs contiguous fp32 statistics")
    if stats.numel() >= 2**31:
        raise ValueError(f"fold_stats: {stats.numel()} elements need 64-bit offsets")
    scratch = stats.new_empty((s, -(-k // FAN), c))
    if c == 0:
        return scratch[:, 0]
    _fold_stats_kernel[(triton.cdiv(c, TILE_N),)](
        stats, per * c, s * per * c, per, scratch, scratch.shape[1] * c, c, k, fold_passes(k),
        WITH_ENT=spec.entropy, WITH_SQ=spec.sum_pi_squared, TILE_N=TILE_N,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return scratch[:, 0]
