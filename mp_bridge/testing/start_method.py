"""How the test kit starts its ranks: ``fork`` where that is safe, ``forkserver`` where not.

``fork`` copies the caller's process as it is: ~3 s for 8 ranks on 2 cores, because
``torch`` is already imported. It is unsafe once CUDA lives in the caller: a forked child
cannot re-initialize CUDA ("Cannot re-initialize CUDA in forked subprocess"), and on a
machine with a GPU the first backward pass, even of CPU tensors, starts autograd's
per-device threads, after which a forked child dies in its first backward ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"). Python
cannot see those threads, so a machine with a visible GPU never forks.

``forkserver`` starts one clean server process (an ``exec`` of Python, no CUDA, no
autograd threads) that imports :data:`PRELOAD` once and forks every rank from itself: each
later world starts about as fast as with ``fork``. The price is ``spawn``'s contract:
what a rank runs travels pickled, so a case function must be importable (module level),
and a :class:`~mp_bridge.testing.DistributedWorld` travels as a reference to the module
that defines it (see :mod:`mp_bridge.testing`).

The rule is :func:`choose_start_method` (pure, unit-tested on literal facts);
:func:`rank_start_method` feeds it this process's facts. ``MP_BRIDGE_START_METHOD``
(``fork`` / ``forkserver`` / ``spawn``) overrides it; CI forces ``forkserver`` on whole
functional files so the CUDA-safe path is exercised on CPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import torch

__all__ = ["PRELOAD", "START_METHODS", "choose_start_method", "rank_context", "rank_start_method"]

START_METHODS = ("fork", "forkserver", "spawn")
#: Imported once by the forkserver, so each rank it forks starts with them loaded.
PRELOAD = ("torch", "torch.distributed", "mp_bridge.testing", "mp_bridge.models")


def choose_start_method(
    *, override: str | None, rank_device_type: str, cuda_initialized: bool, cuda_available: bool
) -> str:
    """The start method for a world, from the facts that decide it.

    ``override``: ``MP_BRIDGE_START_METHOD`` (``None`` or ``""``: not set) wins. Otherwise
    ``forkserver`` when the ranks' device is CUDA, when this process has initialized CUDA,
    or when CUDA is available at all (autograd's device threads, invisible from Python,
    start with the first backward); ``fork`` on a machine without CUDA.

    >>> choose_start_method(override=None, rank_device_type="cpu",
    ...                     cuda_initialized=False, cuda_available=False)
    'fork'
    """
    if override:
        method = override.strip().lower()
        if method not in START_METHODS:
            raise ValueError(
                f"MP_BRIDGE_START_METHOD={override!r} is not a start method; "
                f"use one of {list(START_METHODS)} or unset it"
            )
        return method
    if rank_device_type == "cuda" or cuda_initialized or cuda_available:
        return "forkserver"
    return "fork"


def rank_start_method(rank_device_type: str = "cpu") -> str:
    """:func:`choose_start_method` with this process's facts (``torch.cuda`` is asked
    only when the answer is not already decided, so a CPU build never probes CUDA)."""
    override = os.environ.get("MP_BRIDGE_START_METHOD")
    cuda_built = torch.backends.cuda.is_built()
    return choose_start_method(
        override=override,
        rank_device_type=rank_device_type,
        cuda_initialized=cuda_built and torch.cuda.is_initialized(),
        cuda_available=cuda_built and not override and torch.cuda.is_available(),
    )


def rank_context(rank_device_type: str = "cpu", method: str | None = None) -> Any:
    """The ``multiprocessing`` context the ranks start from: ``method``, or by the rule
    (:func:`rank_start_method`); a forkserver preloads :data:`PRELOAD`."""
    method = method or rank_start_method(rank_device_type)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Only before the server starts does this take effect; later calls are no-ops.
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
