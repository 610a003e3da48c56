"""The triton engine's default mode outside the kernels: no silent ``addmm`` fallback, and
fp32 cuBLAS products kept exact whatever the caller set for TF32.

On CPU: ``choose_addmm_path`` on a call that runs and on one that fails (the warning names
the error, once per process through ``addmm_path``'s cache), and ``exact_fp32`` under each
way a user turns TF32 on (legacy flag, ``set_float32_matmul_precision``, the new API),
restoring the user's setting; ``exact_reduction`` likewise for torch's bf16 / fp16
reduced-precision switches; ``mm_into_``'s CPU stand-in (one rounding of the fp32 sum,
written in place). The GPU run names the chosen path (``bench/gpu/speed.py``), and on CUDA
``mm_into_`` stays at the bf16 rounding floor with the user's reduced-precision switch on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_engine import DEVICE  # noqa: F401 - TRITON_INTERPRET, importorskip

from mp_bridge.layers.loss.engines.triton_ops import default as triton_default  # noqa: E402  # isort: skip

ROOT = Path(__file__).resolve().parents[2]


def test_a_working_addmm_is_chosen_without_a_warning(recwarn):
    assert triton_default.choose_addmm_path(lambda: None) == triton_default.ADDMM_OUT_DTYPE
    assert not recwarn.list


@pytest.mark.parametrize("error", [TypeError, RuntimeError, NotImplementedError])
def test_a_failing_addmm_is_named_in_a_warning(error):
    def fails():
        raise error("addmm() got an unexpected keyword argument 'out_dtype'")

    with pytest.warns(RuntimeWarning, match=rf"{error.__name__}: addmm\(\) got an unexpected"):
        assert triton_default.choose_addmm_path(fails) == triton_default.MM_THEN_ADD


def test_a_wrong_addmm_result_is_an_error_not_a_fallback():
    def wrong():
        raise AssertionError("addmm(out_dtype=float32, out=acc) gave 1.0")

    with pytest.raises(AssertionError):
        triton_default.choose_addmm_path(wrong)


def test_the_cpu_path_is_named():
    assert "CPU" in triton_default.addmm_path("cpu")


#: How a user turns TF32 on for cuBLAS fp32 matmuls (torch 2.9+ maps each onto
#: ``torch.backends.cuda.matmul.fp32_precision``).
_USER = (
    "mm.allow_tf32 = True",
    "torch.set_float32_matmul_precision('high')",
    "mm.fp32_precision = 'tf32'",
)


def test_exact_fp32_turns_tf32_off_inside_and_restores_the_users_setting():
    # in a fresh process: the user's setting is process-global
    code = f"""
import torch
from mp_bridge.layers.loss.engines.triton_ops.default import exact_fp32
mm = torch.backends.cuda.matmul
for user in {_USER!r}:
    exec(user)
    before = mm.fp32_precision
    assert before == "tf32", (user, before)
    with exact_fp32():
        assert mm.fp32_precision == "ieee", (user, mm.fp32_precision)
    assert mm.fp32_precision == before, (user, mm.fp32_precision)
    mm.fp32_precision = "none"
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_exact_reduction_turns_reduced_precision_off_inside_and_restores_the_users():
    code = """
import torch
from mp_bridge.layers.loss.engines.triton_ops.default import exact_reduction
mm = torch.backends.cuda.matmul
for user in ((True, True), (False, False), (False, True)):
    mm.allow_bf16_reduced_precision_reduction = user
    mm.allow_fp16_reduced_precision_reduction = user
    mm.allow_fp16_accumulation = True
    for dt, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        flag = f"allow_{name}_reduced_precision_reduction"
        with exact_reduction(dt):
            assert getattr(mm, flag) is False, (user, name)
            assert getattr(mm, flag + "_split_k") is user[1], (user, name)  # kept
            assert mm.allow_fp16_accumulation is (dt == torch.bfloat16), (user, name)
        assert (getattr(mm, flag), getattr(mm, flag + "_split_k")) == user, (user, name)
        assert mm.allow_fp16_accumulation is True
    with exact_reduction(torch.float32):  # nothing to guard
        assert mm.allow_bf16_reduced_precision_reduction is user[0]
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mm_into_writes_one_rounding_of_the_fp32_sum_into_its_rows(dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(700, 48, generator=g).to(dtype).t()  # (48, 700): g^T's layout
    b = torch.randn(700, 40, generator=g).to(dtype)
    gw = torch.full((100, 40), 7.0, dtype=dtype)
    triton_default.mm_into_(gw[16:64], a, b)
    assert torch.equal(gw[16:64], (a.float() @ b.float()).to(dtype))  # the fp32 sum, rounded
    assert (gw[:16] == 7).all() and (gw[64:] == 7).all()  # its rows only, in place
    if dtype != torch.float32:  # one rounding: at the floor of rounding the exact sum
        ref = a.double() @ b.double()
        floor = (ref.to(dtype).double() - ref).norm()
        assert (gw[16:64].double() - ref).norm() <= 1.05 * floor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS: the GPU run's unit stage")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mm_into_on_cuda_stays_at_the_rounding_floor(dtype):
    # a long reduction and a small output: where cuBLAS picks split-K; the user allows
    # reduced-precision reductions (torch's default), mm_into_ must not use them
    mm = torch.backends.cuda.matmul
    flag = "allow_bf16_reduced_precision_reduction" if dtype == torch.bfloat16 else (
        "allow_fp16_reduced_precision_reduction")  # fmt: skip
    old = (getattr(mm, flag), getattr(mm, f"{flag}_split_k"))
    setattr(mm, flag, True)
    try:
        g = torch.Generator().manual_seed(5)
        a = torch.randn(65536, 64, generator=g).to("cuda", dtype).t()
        b = torch.randn(65536, 64, generator=g).to("cuda", dtype) / 16
        out = torch.empty(64, 64, dtype=dtype, device="cuda")
        triton_default.mm_into_(out, a, b)
        assert getattr(mm, flag) is True  # restored
    finally:
        setattr(mm, flag, old)
    ref = a.double() @ b.double()
    floor = (ref.to(dtype).double() - ref).norm()
    assert (out.double() - ref).norm() <= 1.1 * floor
