"""The few collectives a save and a load run outside DCP, over the ranks of the model.

A checkpoint is collective over every rank of the default world (``None`` when
``torch.distributed`` is not initialized: one process, no collective). Errors found on
one rank before DCP runs are exchanged first (:func:`agree_on_errors`, through
:mod:`mp_bridge.checks.agreement`), so every rank raises the same error and none is left
waiting in a collective.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mp_bridge.checks.agreement import AgreementError, check_agreement

__all__ = [
    "DCP_ERRORS",
    "agree_on_errors",
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


#: Where the checkpoint's error exchanges say they are (one call site for all of them).
_WHERE = "mp_bridge.checkpoint"
_KINDS = {"ValueError": ValueError, "TypeError": TypeError,
          "FileNotFoundError": FileNotFoundError}  # fmt: skip


def agree_on_errors(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Raise, on every rank, the same error: the first failing rank's (its type, and its
    message with ``(rank r)`` appended when the group has more than one rank); return when
    no rank has one. :func:`~mp_bridge.checks.agreement.check_agreement` always on: one
    all-gather of a small int64 row, plus one ``all_gather_object`` when a rank failed."""
    try:
        check_agreement(_WHERE, group, {}, error=error, always=True)
    except AgreementError as exc:
        if not exc.failures:  # ranks in different calls: its own message says which
            raise
        rank, kind, message = exc.failures[0]
        raise _KINDS.get(kind, RuntimeError)(f"{message} (rank {rank})") from error


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
