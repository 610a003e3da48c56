"""Compile every kernel of the ``"triton"`` loss engine for an H100 / H200 (sm_90) on a
machine without a GPU: the code path the interpreter does not run (``tl.dot`` on bf16 and
on fp32 in ``"ieee"`` precision).

``python -m tests.triton_compile`` prints one line per kernel: registers, stack and local
bytes per thread (``cuobjdump -res-usage`` of the cubin). Run in a process without
``TRITON_INTERPRET`` (``tests/unit/test_triton_compile.py`` does), since under it the
kernels are interpreted functions with nothing to compile.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK
from mp_bridge.layers.loss.engines.triton_ops import (
    block_dweight,
    block_grad,
    block_stats,
    dhidden,
    row_grad,
    row_stats,
)

TARGET = GPUTarget("cuda", 90, 32)
#: Per-token fp32 vectors (``w_ptr`` is one in ``row_grad``, the weight in the block kernels).
ROW = ("temp_ptr", "lse_ptr", "w_tok_ptr", "went_ptr", "ent_ptr")
#: The fp32 class weights of the shard's columns (``HAS_CW``).
COLUMN = ("cw_ptr",)
FLOATS = ("cap", "coef_a", "coef_b", "coef_c", "zw2")
ALL_ON = dict(
    HAS_CAP=True, HAS_Z=True, HAS_ENT=True, WITH_ENT=True, WITH_SQ=True, HAS_CW=True, APART=True
)
TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _kernels(dt: str):
    """``(kernel, pointer dtypes by name, constexprs)``; other pointers hold ``dt``. The
    block kernels at the tiles they are launched with for ``dt`` where nothing is
    16-divisible (as here: no divisibility attributes)."""
    tm = block_stats.row_tile(TORCH[dt])
    stats, _ = block_stats.stats_build(TORCH[dt])
    grad = dict(TILE_M=tm if dt == "fp32" else block_grad.NARROW_M, BK=stats["BK"])
    yield (
        row_stats._row_stats_kernel,
        {"z_ptr": "fp32", "stats_ptr": "fp32"},
        dict(FIRST=False, ROWS=row_stats.ROWS, COLS=row_stats.COLS),
    )
    yield (
        row_grad._row_grad_kernel,
        {"z_ptr": "fp32", "w_ptr": "fp32"},
        dict(ROWS=row_grad.ROWS, COLS=row_grad.COLS, INTERPRET=False),
    )
    block = dict(BLOCK=VOCAB_BLOCK, INTERPRET=False)
    yield block_stats._block_stats_kernel, {"stats_ptr": "fp32"}, dict(block, **stats)
    yield block_grad._block_grad_kernel, {}, dict(block, **grad)
    dh = (
        (dhidden.TILE_M_FP32, dhidden.BH_FP32, dhidden.BK_FP32)
        if dt == "fp32"
        else (dhidden.TILE_M, dhidden.BH, dhidden.BK)
    )
    yield (
        dhidden._dhidden_kernel,
        {"out_ptr": "fp32"},
        dict(TILE_M=dh[0], BH=dh[1], BK=dh[2], INTERPRET=False),
    )
    yield (
        block_dweight._block_dweight_kernel,
        {"out_ptr": "fp32"},
        dict(
            TILE_M=block_dweight.TILE_K,
            BVW=block_dweight.BVW,
            BH=block_dweight.BH,
            ADD=True,
            GROUP_V=block_dweight.GROUP_V,
            INTERPRET=False,
        ),
    )


def _signature(fn, pointers: dict[str, str], consts: dict, dt: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "tcol_ptr":
            sig[name] = "*i64"
        elif name in ROW or name in COLUMN:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, dt)
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def compile_all(dtypes=("bf16", "fp32")) -> list[str]:
    """One ``"name dtype: REG:.. STACK:.. LOCAL:.."`` line per compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    lines = []
    for dt in dtypes:
        for fn, pointers, consts in _kernels(dt):
            consts = {k: v for k, v in {**ALL_ON, **consts}.items() if k in fn.arg_names}
            src = ASTSource(fn, _signature(fn, pointers, consts, dt), consts)
            kernel = triton.compile(src, target=TARGET, options={"num_warps": 8})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
            usage = [w for w in out.stdout.split() if w.split(":")[0] in ("REG", "STACK", "LOCAL")]
            lines.append(f"{fn.__name__} {dt}: {' '.join(usage)}")
    return lines


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels do not compile")
    print("\n".join(compile_all()))
