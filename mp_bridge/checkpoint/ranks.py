"""The few collectives a save and a load run outside DCP, over the ranks of the model.

A checkpoint is collective over every rank of the default world (``None`` when
``torch.distributed`` is not initialized: one process, no collective). Errors found on
one rank before DCP runs are exchanged first (:func:`agree_errors`), so every rank raises
the same error and none is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "DCP_ERRORS",
    "agree_errors",
    "broadcast",
    "checkpoint_group",
    "dcp_errors",
    "dcp_quietly",
    "gather",
    "is_coordinator",
]


def checkpoint_group() -> dist.ProcessGroup | None:
    """The group a checkpoint is collective over: the world, or ``None`` (one process)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def is_coordinator(group: dist.ProcessGroup | None) -> bool:
    """Rank 0 of ``group`` (the one that publishes and writes ``mp_bridge.json``)."""
    return group is None or dist.get_rank(group) == 0


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order (one ``all_gather_object``)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``obj`` on every rank (one ``broadcast_object_list``)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def agree_errors(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise, on every rank, the same error: the first rank's (its type and message, with
    that rank named when the world has more than one); return when no rank has one.
    One gather."""
    found = gather(None if error is None else (type(error).__name__, str(error)), group)
    for rank, item in enumerate(found):
        if item is None:
            continue
        kind, message = item
        cls = {"ValueError": ValueError, "TypeError": TypeError,
               "FileNotFoundError": FileNotFoundError}.get(kind, RuntimeError)  # fmt: skip
        where = "" if len(found) == 1 else f" (rank {rank})"
        raise cls(f"{message}{where}") from error


#: What a failed DCP save or load raises: DCP's ``CheckpointException`` is a
#: ``BaseException`` (an ``except Exception`` lets it through), the rest are our planners'.
DCP_ERRORS = (Exception, CheckpointException)


def dcp_errors(exc: BaseException) -> str:
    """A failed DCP call in one line: each failing rank's exception (type and message),
    without DCP's tracebacks. E.g. ``rank 1: UnpicklingError: Weights only load failed``."""
    if not isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {exc}"
    return "; ".join(
        f"rank {rank}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        for rank, (err, _) in sorted(exc.failures.items())
    )


@contextlib.contextmanager
def dcp_quietly() -> Iterator[None]:
    """Run DCP without its warning that one process is "assuming single process" (we
    pass ``no_dist=True`` on purpose there)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
