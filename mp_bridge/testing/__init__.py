"""Multi-process test kit: ``run_distributed``, one-world test suites, collective counting."""

from .collectives import CollectiveCall, CollectiveCounter
from .launcher import DistributedError, current_device, run_distributed, under_torchrun
from .world import DistributedWorld, world_backend

__all__ = [
    "CollectiveCall",
    "CollectiveCounter",
    "DistributedError",
    "DistributedWorld",
    "current_device",
    "run_distributed",
    "under_torchrun",
    "world_backend",
]
