"""Default mode, backward: ``d loss / d logits`` of one vocab slab, one pass, no reduction.

One program per ``[ROWS, COLS]`` tile of the slab's raw fp32 logits ``z [N, Vs]``:
``transform``, then ``tile_grad`` from the row's global ``lse`` (and entropy), its
factors ``w`` (``1 / T`` times the upstream gradient, 0 on ignored tokens) and
``w_ent``; written in the dtype of ``out`` (the GEMM operand dtype: bf16 / fp16 inputs
get their gradient rounded once, as every fused kernel and megatron's materialized path
do; fp32 writes in place over ``z``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mp_bridge.layers.loss.engines.triton.tiles import tile_grad, transform
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["COLS", "ROWS", "row_grad"]

#: ``[16, 512]`` tiles: element-wise work, one tile per program.
ROWS = 16
COLS = 512
NUM_WARPS = 8


@triton.jit
def _row_grad_kernel(
    z_ptr,
    z_stride,
    out_ptr,
    out_stride,
    temp_ptr,
    tcol_ptr,
    lse_ptr,
    w_ptr,
    went_ptr,
    ent_ptr,
    n_rows,
    n_cols,
    num_valid,
    col0,
    cap,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    HAS_CAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    rmask = rows < n_rows
    inside = rmask[:, None] & (cols < n_cols)[None, :]
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    tcol = tl.load(tcol_ptr + rows, mask=rmask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    w = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    w_ent = tl.zeros((ROWS,), tl.float32)
    ent = tl.zeros((ROWS,), tl.float32)
    if HAS_ENT:
        w_ent = tl.load(went_ptr + rows, mask=rmask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
    x = tl.load(z_ptr + rows[:, None] * z_stride + cols[None, :], mask=inside, other=0.0)
    z, deriv = transform(x, temp, cap, HAS_CAP)
    valid = inside & ((cols + col0) < num_valid)[None, :]
    is_target = valid & ((cols + col0)[None, :] == tcol[:, None])
    g = tile_grad(
        z, deriv, valid, is_target, lse, w, w_ent, ent, coef_a, coef_b, coef_c, zw2,
        HAS_Z, HAS_ENT, HAS_CAP,
    )  # fmt: skip
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, g.to(out_ptr.dtype.element_ty), mask=inside)


def row_grad(
    z: torch.Tensor,
    out: torch.Tensor,
    temp: torch.Tensor,
    tcol: torch.Tensor,
    lse: torch.Tensor,
    w: torch.Tensor,
    w_ent: torch.Tensor | None,
    ent: torch.Tensor | None,
    *,
    num_valid: int,
    col0: int,
    spec: LossSpec,
) -> torch.Tensor:
    """``out [N, Vs] <- d loss / d z`` (``out`` may be ``z`` itself); returns ``out``."""
    n, vs = z.shape
    if n == 0 or vs == 0:
        return out
    a, b, c = spec.coefficients
    _row_grad_kernel[(triton.cdiv(n, ROWS), triton.cdiv(vs, COLS))](
        z,
        z.stride(0),
        out,
        out.stride(0),
        temp,
        tcol,
        lse,
        w,
        w if w_ent is None else w_ent,
        w if ent is None else ent,
        n,
        vs,
        num_valid,
        col0,
        float(spec.softcap or 1.0),
        a,
        b,
        c,
        2.0 * spec.z_loss_weight,
        HAS_CAP=spec.softcap is not None,
        HAS_Z=spec.z_loss_weight != 0.0,
        HAS_ENT=spec.entropy,
        ROWS=ROWS,
        COLS=COLS,
        num_warps=NUM_WARPS,
    )
    return out
