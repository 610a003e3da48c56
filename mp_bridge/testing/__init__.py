"""Multi-process test kit: ``run_distributed``, one-world test suites, collective counting."""

from mp_bridge.testing.collectives import CollectiveCall, CollectiveCounter
from mp_bridge.testing.launcher import (
    DistributedError,
    current_device,
    run_distributed,
    under_torchrun,
)
from mp_bridge.testing.world import DistributedWorld, world_backend

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
