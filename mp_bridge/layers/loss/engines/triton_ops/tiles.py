"""The ``@triton.jit`` math every kernel of the triton engine shares (no launches here).

A tile is ``[R, C]`` fp32 raw logits ``x`` (rows: tokens, columns: vocab ids) with
per-row vectors ``[R]``. The math is ``formulas``'s docstring, in the same statistic
layout (``formulas.STATS``), so the torch-side merges, folds and ``stats_values`` apply
unchanged to what the kernels write:

- ``transform``: ``z = softcap(x) / T`` with ``softcap(x) = c tanh(x / c)``; returns ``z``
  and ``d softcap / dx = 1 - tanh**2`` (``tanh`` from one ``exp``: ``tl`` has none that the
  interpreter also runs);
- ``tile_stats``: per row over the tile's true columns, shifted by the tile's own max
  ``m``: ``(m, s = sum e, target z, sum z, u = sum e (z - m), q = sum e**2)``,
  ``e = exp(z - m)``; a row with no true column is the merge identity ``(-inf, 0, 0, 0,
  0, 0)``;
- ``merge_stats2``: the online log-sum-exp merge of two such partials (left, right);
- ``tile_grad``: ``d/dx`` of ``w value + w_ent H`` per row (``w`` already holds ``1 /
  T`` and the upstream gradient): ``(p k + c w [true]) - w_ent p log p + (w b) [target]``
  with ``k = (a + 2 zw lse) w - w_ent H`` and ``p = exp(z - lse)``, times the soft-cap
  derivative.
- class weights (``class_weights``, a ``HAS_CW`` constexpr that compiles out without
  them): ``sz`` is ``sum w_c z_c`` (``stats_of``), and ``tile_grad`` reads the per-row
  ``w a``, ``w b`` and adds ``(w c) w_j`` on true columns.
- ``rounded``: ``g`` in the dtype of the pointer it is stored to, round to nearest even (the
  GPU's conversion; the interpreter truncates fp32 -> bf16, so there it is done on the
  bits).
- ``dot_acc``: ``acc + x @ y`` with fp32 accumulation. On a GPU ``tl.dot`` (bf16 / fp16
  operands as they are, their products exact in fp32; fp32 operands in ``"ieee"``
  precision, never TF32). Under ``TRITON_INTERPRET=1`` the interpreter's ``tl.dot`` is
  numpy's BLAS matmul, whose bits depend on a row's position in the tile (and which
  misreads bf16): the stand-in multiplies and sums over ``k`` with a broadcast, the same
  exact products and an fp32 sum in a fixed ``k`` order, so the same code path keeps its
  row-by-row bits there too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.class_weights import column_weights
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = [
    "FP_FUSION",
    "INTERPRET",
    "block_logits",
    "dot_acc",
    "grad_of",
    "grad_params",
    "kernel_column_weights",
    "rounded",
    "stats_at",
    "stats_of",
    "stats_params",
    "merge_stats2",
    "tile_grad",
    "tile_stats",
    "transform",
]

#: Whether the kernels run under Triton's CPU interpreter (read once, at import: the
#: interpreter itself is chosen by the same variable when the kernels are decorated).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: Every launch passes ``enable_fp_fusion=FP_FUSION``: no FMA contraction of the
#: element-wise math, whatever ``TRITON_DEFAULT_FP_FUSION`` says or Triton's default is
#: (on in 3.9, off from 3.10). ``False``, not ``True``: ``TRITON_FORCE_DISABLE_FP_FUSION=1``
#: overrides a pinned ``True`` but agrees with ``False``, so no variable can move a bit;
#: and each multiply and add rounds once, as under the interpreter.
FP_FUSION = False


@triton.jit
def dot_acc(x, y, acc, INTERPRET: tl.constexpr):
    """``acc [M, N] + x [M, K] @ y [K, N]`` in fp32 (see the module docstring)."""
    if INTERPRET:
        xf = x.to(tl.float32)
        yf = y.to(tl.float32)
        return acc + tl.sum(xf[:, :, None] * yf[None, :, :], axis=1)
    else:  # "ieee": fp32 operands never in TF32; bf16 / fp16 ones are exact either way
        return tl.dot(x, y, acc, input_precision="ieee")


@triton.jit
def rounded(g, ptr, INTERPRET: tl.constexpr):
    """fp32 ``g`` in ``ptr``'s element dtype, rounded to nearest even (see the module
    docstring: under the interpreter a bf16 target is rounded on the fp32 bits)."""
    if INTERPRET and ptr.dtype.element_ty == tl.bfloat16:
        bits = g.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # finite values: RTNE to 16 bits
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return g.to(ptr.dtype.element_ty)


@triton.jit
def transform(x, temp, cap, HAS_CAP: tl.constexpr):
    """``(softcap(x) / temp[:, None], d softcap / dx)`` (the derivative 1 without a cap)."""
    if HAS_CAP:
        y = x / cap
        e = tl.exp(-2.0 * tl.abs(y))  # tanh |y| = (1 - e) / (1 + e), no overflow
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(y < 0, -t, t)
        z = cap * t
        deriv = 1.0 - t * t
    else:
        z = x
        deriv = tl.full(x.shape, 1.0, tl.float32)
    return z / temp[:, None], deriv


@triton.jit
def tile_stats(z, valid, is_target, zs):
    """Per-row ``(m, s, tl, sz, u, q)`` of the true columns ``valid`` of ``z [R, C]``;
    ``sz`` sums ``zs`` (``z``, or ``z`` times the column weights)."""
    tlg = tl.sum(tl.where(is_target, z, 0.0), 1)
    sz = tl.sum(tl.where(valid, zs, 0.0), 1)
    m = tl.max(tl.where(valid, z, float("-inf")), 1)
    shift = tl.where(m == float("-inf"), 0.0, m)
    d = tl.where(valid, z - shift[:, None], float("-inf"))
    e = tl.exp(d)  # 0 off the true columns
    s = tl.sum(e, 1)
    u = tl.sum(e * tl.where(e > 0, d, 0.0), 1)  # 0 log 0 = 0, no nan
    q = tl.sum(e * e, 1)
    return m, s, tlg, sz, u, q


@triton.jit
def merge_stats2(m1, s1, t1, z1, u1, q1, m2, s2, t2, z2, u2, q2):
    """Online log-sum-exp merge of two per-row partials (``formulas.merge_stats``)."""
    m = tl.maximum(m1, m2)
    shift = tl.where(m == float("-inf"), 0.0, m)
    d1 = m1 - shift
    d2 = m2 - shift
    c1 = tl.exp(d1)
    c2 = tl.exp(d2)
    u = (u1 + tl.where(s1 > 0, d1, 0.0) * s1) * c1 + (u2 + tl.where(s2 > 0, d2, 0.0) * s2) * c2
    return m, s1 * c1 + s2 * c2, t1 + t2, z1 + z2, u, q1 * c1 * c1 + q2 * c2 * c2


@triton.jit
def tile_grad(
    z,
    deriv,
    valid,
    is_target,
    lse,
    w,
    w_ent,
    ent,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    cw,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_CW: tl.constexpr,
):
    """``d loss / d x [R, C]`` of transformed logits ``z`` (see the module docstring);
    ``zw2 = 2 z_loss_weight``; 0 on columns that are not ``valid``. ``HAS_CW`` (class
    weights, cross-entropy: no entropy): ``w_ent`` holds ``w a`` and ``ent`` ``w b`` per
    row, ``cw [C]`` the column weights, so the ``c`` term is ``(w c) cw``."""
    logp = z - lse[:, None]
    p = tl.where(valid, tl.exp(logp), 0.0)
    if HAS_CW:
        k = w_ent
    else:
        k = w * coef_a
    if HAS_Z:
        k += w * lse * zw2
    if HAS_ENT:
        k -= w_ent * ent
    if HAS_CW:
        # no mask on the c term: cw is 0 past the true columns (and masked rows are never
        # stored), and adding the target term's +0 there turns a -0 into +0: the same bits
        g = p * k[:, None] + (w * coef_c)[:, None] * cw[None, :]
        g += tl.where(is_target, ent[:, None], 0.0)
    else:
        g = p * k[:, None] + tl.where(valid, (w * coef_c)[:, None], 0.0)
        if HAS_ENT:
            g -= tl.where(p > 0, p * logp, 0.0) * w_ent[:, None]
        g += tl.where(is_target, (w * coef_b)[:, None], 0.0)
    if HAS_CAP:
        g = g * deriv
    return g


@triton.jit
def _kstep(hp, wp, rmask, ma, mb, w_stride, hidden, k0, SECOND: tl.constexpr, BK: tl.constexpr):
    """``k`` step ``k0`` of the logits: the hidden tile ``[R, BK]`` (row pointers ``hp``)
    and the weight tiles ``[BK, C]`` at column pointers ``wp`` and, when ``SECOND > 0``,
    ``SECOND`` weight rows further (``ma`` / ``mb``: their rows that exist); zeros past
    the tokens, the weight rows and ``hidden``."""
    ks = k0 + tl.arange(0, BK)
    kmask = ks < hidden
    x = tl.load(hp + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    y = tl.load(wp + ks[:, None], mask=ma[None, :] & kmask[:, None], other=0.0)
    y2 = y
    if SECOND > 0:
        m2 = mb[None, :] & kmask[:, None]
        y2 = tl.load(wp + SECOND * w_stride + ks[:, None], mask=m2, other=0.0)
    return x, y, y2


@triton.jit
def block_logits(
    h_ptr,
    h_stride,
    w_ptr,
    w_stride,
    rows,
    rmask,
    cols,
    w_rows,
    hidden,
    TILE_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Raw fp32 logits ``[TILE_M, BLOCK]`` of token ``rows`` against weight rows ``cols``:
    ``sum_k h[r, k] W[c, k]`` over ``k`` in steps of ``BK`` from 0, in order (no split-K);
    rows past the tokens and weight rows past ``w_rows`` load zeros. Every element's
    bits depend on its own row and column alone (fixed tile shapes, one program each).
    Returns ``(logits, zeros)``; with ``SPLIT``, ``cols`` are the first ``BLOCK / 2`` rows
    and the two ``[TILE_M, BLOCK / 2]`` halves come back as two accumulators sharing each
    loaded hidden tile (the same sums; an epilogue can finish one before the other)."""
    HALF: tl.constexpr = BLOCK // 2 if SPLIT else BLOCK
    SECOND: tl.constexpr = HALF if SPLIT else 0
    acc_a = tl.zeros((TILE_M, HALF), tl.float32)
    acc_b = tl.zeros((TILE_M, HALF), tl.float32)
    hp = h_ptr + rows[:, None] * h_stride
    wp = w_ptr + cols[None, :] * w_stride
    for k0 in range(0, hidden, BK):
        x, ya, yb = _kstep(hp, wp, rmask, cols < w_rows, cols + SECOND < w_rows, w_stride,
                           hidden, k0, SECOND, BK)  # fmt: skip
        acc_a = dot_acc(x, ya, acc_a, INTERPRET)
        if SPLIT:
            acc_b = dot_acc(x, yb, acc_b, INTERPRET)
    return acc_a, acc_b


@triton.jit
def stats_of(
    x, ids, inside, rows, rmask, temp_ptr, tcol_ptr, cw_ptr, num_valid, cap,
    HAS_CAP: tl.constexpr, HAS_CW: tl.constexpr,
):  # fmt: skip
    """``tile_stats`` of raw logits ``x [R, C]``: rows ``rows`` (``rmask``: real
    tokens), columns the shard's local ids ``ids [C]`` (true below ``num_valid``),
    ``inside``: the tile's elements that exist; ``HAS_CW``: the sum weighted by the
    column weights ``cw_ptr [num_valid]`` (local ids)."""
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    tcol = tl.load(tcol_ptr + rows, mask=rmask, other=-1)
    return stats_at(x, ids, inside, temp, tcol, cw_ptr, num_valid, cap, HAS_CAP, HAS_CW)


@triton.jit
def stats_at(
    x, ids, inside, temp, tcol, cw_ptr, num_valid, cap, HAS_CAP: tl.constexpr,
    HAS_CW: tl.constexpr,
):  # fmt: skip
    """``stats_of`` with the rows' temperatures ``temp`` and target columns ``tcol``
    already loaded (a kernel with several tiles per row loads them once)."""
    z, _ = transform(x, temp, cap, HAS_CAP)
    valid = inside & (ids < num_valid)[None, :]
    zs = z
    if HAS_CW:
        zs = z * tl.load(cw_ptr + ids, mask=ids < num_valid, other=0.0)[None, :]
    return tile_stats(z, valid, valid & (ids[None, :] == tcol[:, None]), zs)


@triton.jit
def grad_of(
    x,
    ids,
    inside,
    rows,
    rmask,
    temp_ptr,
    tcol_ptr,
    lse_ptr,
    w_ptr,
    went_ptr,
    ent_ptr,
    cw_ptr,
    num_valid,
    cap,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    HAS_CAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_CW: tl.constexpr,
):
    """``tile_grad`` of raw logits ``x [R, C]`` (rows, ids, masks: ``stats_of``), the
    per-row inputs loaded from their ``[N]`` vectors (``went`` / ``ent``: with
    ``HAS_ENT``; ``w a`` / ``w b`` with ``HAS_CW``, the column weights from ``cw_ptr``)."""
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    tcol = tl.load(tcol_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    w_ent = w * 0.0
    ent = w * 0.0
    cw = w
    if HAS_ENT:
        w_ent = tl.load(went_ptr + rows, mask=rmask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
    if HAS_CW:  # w a and w b in the entropy's places
        w_ent = tl.load(went_ptr + rows, mask=rmask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
        cw = tl.load(cw_ptr + ids, mask=ids < num_valid, other=0.0)
    z, deriv = transform(x, temp, cap, HAS_CAP)
    valid = inside & (ids < num_valid)[None, :]
    is_target = valid & (ids[None, :] == tcol[:, None])
    return tile_grad(
        z, deriv, valid, is_target, lse, w, w_ent, ent, coef_a, coef_b, coef_c, zw2, cw,
        HAS_Z, HAS_ENT, HAS_CAP, HAS_CW,
    )  # fmt: skip


def kernel_column_weights(spec: LossSpec, start: int, size: int):
    """The fp32 class weights of a shard's local ids ``[0, size)`` (global ``start +
    id``; 0 past the vocab), at least one element (a pointer the kernels mask); ``None``
    without class weights."""
    colw = column_weights(spec, start, max(size, 1))
    return None if colw is None else colw.to(torch.float32).contiguous()


def stats_params(spec: LossSpec, colw, stand_in) -> tuple[tuple, dict[str, bool]]:
    """The statistics kernels' trailing arguments ``(column weights, cap)`` and their
    constexpr flags. ``colw``: the shard's fp32 column weights, used (``HAS_CW``) only
    where the value needs the sum (smoothing); ``stand_in`` takes their place otherwise."""
    weighted = colw is not None and spec.with_sum
    flags = dict(HAS_CAP=spec.softcap is not None, WITH_ENT=spec.entropy, HAS_CW=weighted)
    args = (colw if weighted else stand_in, float(spec.softcap or 1.0))
    return args, dict(flags, WITH_SQ=spec.sum_pi_squared)


def grad_params(spec: LossSpec, w, w_ent, ent, colw=None, wab=None) -> tuple[tuple, dict]:
    """The gradient kernels' trailing arguments ``(w, w_ent, ent, colw, cap, a, b, c, 2
    zw)`` (``w`` stands in for absent vectors) and their constexpr flags. With class
    weights (``HAS_CW``): ``wab = (w a, w b)`` per token in the entropy's places
    (``class_weights.token_coefficients``; a cross-entropy has no entropy) and ``colw``
    the shard's fp32 column weights."""
    a, b, c = spec.coefficients
    weighted = colw is not None
    if weighted:
        w_ent, ent = wab
    args = (w, w if w_ent is None else w_ent, w if ent is None else ent)
    args += (colw if weighted else w, float(spec.softcap or 1.0), a, b, c)
    flags = dict(HAS_CAP=spec.softcap is not None, HAS_Z=spec.z_loss_weight != 0.0)
    return (*args, 2.0 * spec.z_loss_weight), dict(flags, HAS_ENT=spec.entropy, HAS_CW=weighted)
