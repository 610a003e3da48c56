"""Every kernel of the ``"triton"`` loss engine compiles for sm_90 (H100 / H200) here, on
a machine without a GPU (``tests/triton_compile.py``): the GPU-only branch of
``tiles.dot_acc`` and the tree fold's ``while`` loop, which the CPU interpreter never
lowers, are at least valid Triton for the GPU the runbook measures on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.triton_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 12, out.stdout  # 6 kernels x (bf16, fp32)
    assert all("REG:" in line for line in lines), out.stdout
