"""Checkpoints that reshard: ``save`` / ``load`` on ``torch.distributed.checkpoint``.

Every tensor is stored as its unpadded global tensor under its single-process name (read
from the ``ShardSpec`` each sharded parameter declares; unmarked = replicated), so a
checkpoint loads at any layout the model accepts.

The wing stands on three floors (held by ``tests/unit/test_architecture.py``): names and
leaf helpers (:mod:`.keys`, :mod:`.locate`, :mod:`.ranks`, :mod:`.dcp_adapter`,
:mod:`.rng`, :mod:`.arguments`); the shared layer (:mod:`.entries`, :mod:`.info`,
:mod:`.publish`, :mod:`.background`, :mod:`.staging`, :mod:`.hf_record`); and three
peers that import only below them: :mod:`.save`, :mod:`.load` and :mod:`.describe` (``inspect``).

A model declares its grids for ``mp_bridge.json`` with a ``checkpoint_grids()`` method
returning ``{part: HyperCommGrid | None}`` (the colocated MIMO model declares
``encoder`` and ``llm``); ``close()`` frees the asynchronous saves' process group and
staging buffers.
"""

from __future__ import annotations

from mp_bridge.checkpoint.background import AsyncSave
from mp_bridge.checkpoint.info import FORMAT_VERSION, CheckpointInfo, read_checkpoint
from mp_bridge.checkpoint.load import load
from mp_bridge.checkpoint.save import close, save

__all__ = [
    "FORMAT_VERSION",
    "AsyncSave",
    "CheckpointInfo",
    "close",
    "load",
    "read_checkpoint",
    "save",
]
