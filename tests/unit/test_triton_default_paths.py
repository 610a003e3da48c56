"""The triton engine's default mode outside the kernels: no silent ``addmm`` fallback, and
fp32 cuBLAS products kept exact whatever the caller set for TF32.

On CPU: ``choose_addmm_path`` on a call that runs and on one that fails (the warning names
the error, once per process through ``addmm_path``'s cache), and ``exact_fp32`` under each
way a user turns TF32 on (legacy flag, ``set_float32_matmul_precision``, the new API),
restoring the user's setting. The GPU run names the chosen path (``bench/gpu/speed.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_engine import DEVICE  # noqa: F401 - TRITON_INTERPRET, importorskip

from mp_bridge.layers.loss.engines.triton_ops import triton_default  # noqa: E402  # isort: skip

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
from mp_bridge.layers.loss.engines.triton_ops.triton_default import exact_fp32
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
