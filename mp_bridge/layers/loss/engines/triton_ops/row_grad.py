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

from mp_bridge.layers.loss.engines.triton_ops.tiles import (
    FP_FUSION,
    INTERPRET,
    grad_of,
    grad_params,
    rounded,
)
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["COLS", "ROWS", "row_grad"]

#: ``[8, 512]`` tiles, 16 values per thread over 8 warps: element-wise work, one tile per
#: program (``[16, 512]`` took 222 registers per thread on the sm_90 build).
ROWS = 8
COLS = 512
NUM_WARPS = 8
NUM_STAGES = 3  # pinned (Triton's default today); no k-loop to pipeline


@triton.jit
def _row_grad_kernel(
    z_ptr,
    z_stride,
    out_ptr,
    out_stride,
    n_rows,
    n_cols,
    col0,
    num_valid,
    temp_ptr,
    tcol_ptr,
    lse_ptr,
    w_ptr,
    went_ptr,
    ent_ptr,
    cw_ptr,
    cap,
    coef_a,
    coef_b,
    coef_c,
    zw2,
    HAS_CAP: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_CW: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    rmask = rows < n_rows
    inside = rmask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(z_ptr + rows[:, None] * z_stride + cols[None, :], mask=inside, other=0.0)
    g = grad_of(
        x, cols + col0, inside, rows, rmask, temp_ptr, tcol_ptr, lse_ptr, w_ptr, went_ptr,
        ent_ptr, cw_ptr, num_valid, cap, coef_a, coef_b, coef_c, zw2, HAS_CAP, HAS_Z, HAS_ENT,
        HAS_CW,
    )  # fmt: skip
    out = out_ptr + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, rounded(g, out_ptr, INTERPRET), mask=inside)


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
    colw: torch.Tensor | None = None,
    wab: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out [N, Vs] <- d loss / d z`` (``out`` may be ``z`` itself); returns ``out``.
    With class weights: ``colw`` the shard's fp32 column weights (by local id), ``wab``
    the per-token ``(w a, w b)`` (``tiles.grad_params``)."""
    n, vs = z.shape
    if n == 0 or vs == 0:
        return out
    args, flags = grad_params(spec, w, w_ent, ent, colw, wab)
    _row_grad_kernel[(triton.cdiv(n, ROWS), triton.cdiv(vs, COLS))](
        z, z.stride(0), out, out.stride(0), n, vs, col0, num_valid, temp, tcol, lse, *args,
        **flags, ROWS=ROWS, COLS=COLS, INTERPRET=INTERPRET, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    return out
