"""What every example does first under ``torchrun``: read its arguments, pick the backend
and device, start the process group. Imported by the examples' ``main()`` only (``torchrun
examples/<name>.py`` puts this folder on ``sys.path``), so tests can load an example's
model and data without it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def parse_args(description: str, *, steps: int, lr: float) -> argparse.Namespace:
    """``--steps``, ``--lr`` and ``--backend`` (``auto``: NCCL when CUDA has a GPU per local
    rank, else gloo)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    return parser.parse_args()


def start(backend: str) -> torch.device:
    """Start the default process group with ``backend``; this rank's device (``cuda:r`` with
    NCCL, where ``r`` is torchrun's ``LOCAL_RANK``; the CPU with gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend == "auto":
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if enough_gpus else "gloo"
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    return device
