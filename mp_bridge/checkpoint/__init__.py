"""Checkpoints that reshard: ``save`` / ``load`` on ``torch.distributed.checkpoint``.

Every tensor is stored as its unpadded global tensor under its single-process name (read
from the ``ShardSpec`` each sharded parameter declares; unmarked = replicated), so a
checkpoint loads at any layout the model accepts. See :mod:`.save` and :mod:`.load`.
"""

from __future__ import annotations

from mp_bridge.checkpoint.info import FORMAT_VERSION, CheckpointInfo
from mp_bridge.checkpoint.load import load
from mp_bridge.checkpoint.save import AsyncSave, save

__all__ = ["FORMAT_VERSION", "AsyncSave", "CheckpointInfo", "load", "save"]
