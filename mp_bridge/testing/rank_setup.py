"""Where a world's ranks run: one frozen :class:`RankSetup`, resolved once per world.

Four environment variables decide it, read here and nowhere else:

- ``MP_BRIDGE_BACKEND`` (``gloo`` default, or ``nccl``): :func:`world_backend`;
- ``MP_BRIDGE_TEST_DEVICE`` (``cpu`` default, ``cuda`` = ``cuda:0``, ``cuda:N``): the
  one-GPU mode, every gloo rank's tensors on that device (:func:`device_under_test`);
- ``MP_BRIDGE_START_METHOD`` (``fork`` / ``forkserver`` / ``spawn``): overrides the rule
  below (:func:`choose_start_method`);
- torchrun's ``TORCHELASTIC_RUN_ID`` with ``RANK`` / ``WORLD_SIZE`` (and ``LOCAL_RANK``):
  the cases run in the launched processes (:func:`under_torchrun`).

:func:`resolve_setup` turns them, with the two CUDA facts of this process, into a
:class:`RankSetup` (pure, unit-tested on literal facts); :func:`rank_setup` feeds it this
process's facts. ``DistributedWorld`` resolves one per world and passes it to the launcher,
which passes it to every rank.

**The start-method rule.** ``fork`` copies the caller's process as it is: ~3 s for 8
ranks on 2 cores, because ``torch`` is already imported. It is unsafe once CUDA lives in
the caller: a forked child cannot re-initialize CUDA ("Cannot re-initialize CUDA in
forked subprocess"), and on a machine with a GPU the first backward pass, even of CPU
tensors, starts autograd's per-device threads, after which a forked child dies in its
first backward ("Unable to handle autograd's threading in combination with fork-based
multiprocessing"). Python cannot see those threads, so a machine with a visible GPU never
forks. ``forkserver`` starts one clean server process (an ``exec`` of Python, no CUDA, no
autograd threads) that imports :data:`PRELOAD` once and forks every rank from itself: each
later world starts about as fast as with ``fork``. The price is ``spawn``'s contract: what
a rank runs travels pickled, so a case function must be importable (module level), and a
:class:`~mp_bridge.testing.DistributedWorld` travels as a reference to the module that
defines it (see :mod:`mp_bridge.testing`). CI forces ``forkserver`` on whole functional
files so the CUDA-safe path is exercised on CPU.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "PRELOAD",
    "START_METHODS",
    "RankSetup",
    "choose_start_method",
    "current_device",
    "device_under_test",
    "rank_setup",
    "resolve_setup",
    "under_torchrun",
    "world_backend",
]

BACKENDS = ("gloo", "nccl")
START_METHODS = ("fork", "forkserver", "spawn")
#: Imported once by the forkserver, so each rank it forks starts with them loaded.
PRELOAD = ("torch", "torch.distributed", "mp_bridge.testing", "mp_bridge.models")
_TORCHRUN_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """Where a world's ranks run: ``backend``, the gloo ranks' ``device`` (under NCCL rank r
    computes on ``cuda:r`` instead), the ``start_method`` of started ranks, and
    ``torchrun_world``: the world size torchrun launched, ``None`` when not under torchrun
    (``local_rank``: this process's ``LOCAL_RANK`` there).

    >>> setup = resolve_setup({}, cuda_initialized=False, cuda_available=False)
    >>> setup.backend, setup.device, setup.start_method, setup.under_torchrun
    ('gloo', device(type='cpu'), 'fork', False)
    """

    backend: str
    device: torch.device
    start_method: str
    torchrun_world: int | None = None
    local_rank: int = 0

    @property
    def under_torchrun(self) -> bool:
        return self.torchrun_world is not None

    @property
    def device_type(self) -> str:
        """The device type the ranks compute on: ``"cuda"`` under NCCL, else ``device``'s."""
        return "cuda" if self.backend == "nccl" else self.device.type

    def context(self) -> Any:
        """The ``multiprocessing`` context ranks start from; a forkserver preloads
        :data:`PRELOAD`."""
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Only before the server starts does this take effect; later calls are no-ops.
            ctx.set_forkserver_preload(list(PRELOAD))
        return ctx

    def bind_device(self, local_rank: int) -> None:
        """Make this rank's device current (before ``init_process_group``): ``cuda:r``
        under NCCL, the one GPU of the one-GPU mode, nothing on CPU."""
        if self.backend == "nccl":
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        elif self.device.type == "cuda":
            torch.cuda.set_device(self.device)


# ---------------------------------------------------------------- the pure rule
def _backend_of(env: Mapping[str, str]) -> str:
    backend = env.get("MP_BRIDGE_BACKEND", "gloo").lower()
    if backend not in BACKENDS:
        raise ValueError(f"MP_BRIDGE_BACKEND={backend!r}; use 'gloo' or 'nccl'")
    return backend


def _device_of(env: Mapping[str, str]) -> torch.device:
    name = env.get("MP_BRIDGE_TEST_DEVICE", "").strip().lower() or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"MP_BRIDGE_TEST_DEVICE={name!r} is not a test device; use 'cpu', 'cuda' or "
            "'cuda:N' (the one-GPU mode: every gloo rank's tensors on that GPU)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def _is_torchrun(env: Mapping[str, str]) -> bool:
    return all(k in env for k in _TORCHRUN_KEYS)


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


def resolve_setup(
    env: Mapping[str, str],
    *,
    backend: str | None = None,
    start_method: str | None = None,
    cuda_initialized: bool,
    cuda_available: bool,
) -> RankSetup:
    """The :class:`RankSetup` that ``env`` and this process's CUDA facts give.

    ``backend`` / ``start_method``: a caller's explicit choice (``run_distributed``'s
    arguments), which wins over ``MP_BRIDGE_BACKEND`` / ``MP_BRIDGE_START_METHOD``.

    >>> env = {"MP_BRIDGE_TEST_DEVICE": "cuda", "TORCHELASTIC_RUN_ID": "1", "RANK": "3",
    ...        "WORLD_SIZE": "8", "LOCAL_RANK": "3"}
    >>> setup = resolve_setup(env, cuda_initialized=False, cuda_available=False)
    >>> setup.device, setup.start_method, setup.torchrun_world, setup.local_rank
    (device(type='cuda', index=0), 'forkserver', 8, 3)
    """
    backend = backend or _backend_of(env)
    device = _device_of(env)
    method = choose_start_method(
        override=start_method or env.get("MP_BRIDGE_START_METHOD"),
        rank_device_type="cuda" if backend == "nccl" else device.type,
        cuda_initialized=cuda_initialized,
        cuda_available=cuda_available,
    )
    torchrun = _is_torchrun(env)
    return RankSetup(
        backend=backend,
        device=device,
        start_method=method,
        torchrun_world=int(env["WORLD_SIZE"]) if torchrun else None,
        local_rank=int(env.get("LOCAL_RANK", "0")) if torchrun else 0,
    )


# ------------------------------------------------------------- this process
def rank_setup(*, backend: str | None = None, start_method: str | None = None) -> RankSetup:
    """:func:`resolve_setup` with this process's environment and CUDA facts (``torch.cuda``
    is asked whether CUDA is available only when the method is not already decided, so a
    CPU build never probes CUDA)."""
    decided = bool(start_method or os.environ.get("MP_BRIDGE_START_METHOD"))
    cuda_built = torch.backends.cuda.is_built()
    return resolve_setup(
        os.environ,
        backend=backend,
        start_method=start_method,
        cuda_initialized=cuda_built and torch.cuda.is_initialized(),
        cuda_available=cuda_built and not decided and torch.cuda.is_available(),
    )


def world_backend() -> str:
    """The backend tests use: ``MP_BRIDGE_BACKEND`` (``gloo`` or ``nccl``), default gloo."""
    return _backend_of(os.environ)


def device_under_test() -> torch.device:
    """The device named by ``MP_BRIDGE_TEST_DEVICE`` (default ``cpu``): ``cuda`` means
    ``cuda:0``, ``cuda:N`` that GPU. This is the one-GPU mode: every gloo rank of a test
    world holds its tensors on that one device while gloo carries the collectives."""
    return _device_of(os.environ)


def under_torchrun() -> bool:
    """Whether this process is a worker started by ``torchrun`` (torch elastic).

    The test is ``TORCHELASTIC_RUN_ID`` (what ``torch.distributed.is_torchelastic_launched``
    checks: torchrun's agent sets it for every worker, nothing else does) plus the ``RANK``
    and ``WORLD_SIZE`` the callers read. ``RANK``/``WORLD_SIZE`` alone are not enough:
    :func:`~mp_bridge.testing.run_distributed` sets them in its started ranks (megatron reads
    them) and users set them for ``env://`` initialization, neither of which is a torchrun
    launch.
    """
    return _is_torchrun(os.environ)


def current_device() -> torch.device:
    """The device this rank's tensors belong on: ``cuda:<local rank>`` under NCCL, else
    :func:`device_under_test` (``MP_BRIDGE_TEST_DEVICE``: CPU by default, or one GPU shared by
    every gloo rank), under any start method and under torchrun."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device_under_test()
