"""pytest plugin: gloo test ranks that hold their tensors on ``cuda:0`` (one GPU).

Why: the test kit puts tensors on ``mp_bridge.testing.current_device()``, which is
``cuda:<rank>`` only under NCCL (``MP_BRIDGE_BACKEND=nccl``). NCCL refuses two ranks on
one GPU, so on a one-GPU machine NCCL worlds stop at one rank. gloo has CUDA paths for
the collectives the library issues (all-reduce, all-gather; tensors staged through host
memory), so the 8-rank worlds of the functional tests can run their tensor math on the
one GPU with gloo carrying the collectives.

With ``MP_BRIDGE_TEST_DEVICE=cuda`` this plugin makes ``current_device()`` return
``cuda:0`` under any backend (gloo stays the default). It is loaded before the test
modules are imported (``-p cuda_ranks`` with this folder on ``PYTHONPATH``), so their
``from mp_bridge.testing import current_device`` binds the replacement. It never touches
CUDA in the pytest process: the ranks are forked, and CUDA must first start in them.

    MP_BRIDGE_TEST_DEVICE=cuda PYTHONPATH=.:bench/gpu python -m pytest -p cuda_ranks \\
        tests/functional/test_fused_loss.py
"""

from __future__ import annotations

import os

import torch


def _cuda0() -> torch.device:
    return torch.device("cuda", 0)


def pytest_configure(config) -> None:  # noqa: ARG001 - the pytest hook's signature
    if os.environ.get("MP_BRIDGE_TEST_DEVICE", "").lower() != "cuda":
        return
    import mp_bridge.testing as kit
    import mp_bridge.testing.launcher as launcher

    kit.current_device = _cuda0
    launcher.current_device = _cuda0
