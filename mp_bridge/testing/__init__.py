"""Multi-process test kit: ``run_distributed``, one-world test suites, collective counting.

Three ways to run a functional suite, one code path:

- **CPU** (default): gloo ranks on this machine, tensors on the CPU.
- **One GPU**: ``MP_BRIDGE_TEST_DEVICE=cuda`` (or ``cuda:N``): gloo ranks whose tensors
  all live on that one GPU (gloo carries the collectives through host memory; NCCL
  refuses two ranks on one device). :func:`current_device` says so in every rank.
- **N GPUs**: ``MP_BRIDGE_BACKEND=nccl torchrun --nproc-per-node N -m pytest ...``: the
  cases run in the launched processes, rank r on ``cuda:r``; a world of another size is
  skipped with its reason.

Start methods: ranks are forked on a machine without CUDA (fast: ``torch`` is already
imported) and started by ``forkserver`` wherever CUDA is (fork after CUDA or after a
backward pass on a GPU machine kills the child); ``MP_BRIDGE_START_METHOD`` overrides.
These four choices (backend, device, start method, torchrun or not) are resolved once per
world into one frozen :class:`RankSetup` (:func:`rank_setup`,
:mod:`mp_bridge.testing.rank_setup`), which the launcher hands to every rank. The contract
that makes every suite run under both:

- a :class:`DistributedWorld` is built at a module's top level and its cases are
  registered at import (decorators at module level): ranks started by forkserver import
  that module and find the world by its place there;
- a function given to :func:`run_distributed` is a module-level function of an
  importable module, and its arguments and return values pickle;
- a case builds its tensors and modules on :func:`current_device` (reference modules,
  megatron's included), or skips on CUDA saying why.
"""

from mp_bridge.testing.collectives import CollectiveCall, CollectiveCounter
from mp_bridge.testing.launcher import DistributedError, run_distributed
from mp_bridge.testing.rank_setup import (
    RankSetup,
    current_device,
    device_under_test,
    rank_setup,
    under_torchrun,
    world_backend,
)
from mp_bridge.testing.world import DistributedWorld

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "DistributedError",
    "DistributedWorld",
    "RankSetup",
    "current_device",
    "rank_setup",
    "run_distributed",
    "device_under_test",
    "under_torchrun",
    "world_backend",
]
