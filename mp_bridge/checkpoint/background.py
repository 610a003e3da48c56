"""Asynchronous saves: the writer thread, the queue of saves still writing, and the one
long-lived process group they write over.

The group (gloo, over every rank of the world) is made the first time an asynchronous
save needs it (collective: every rank's first ``save(..., async_save=True)``) and reused
by every later one: ``dist.new_group`` is collective over the whole world and costs
seconds at thousands of ranks, so it is not paid per save. :func:`release_group` frees it
(``mp_bridge.checkpoint.close()``, and interpreter exit); a world destroyed and made
again gets a new one. gloo: staged tensors are on the CPU, and the writer thread has no
CUDA device of its own (an NCCL group's object collectives there would all use cuda:0).

Saves publish in the order they were made: a save (or load) first waits for every
earlier one of this process (:func:`finish_pending`), so at most one writes at a time
and its staging buffers are free when the next save stages.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["AsyncSave", "finish_pending", "release_group", "writer_group"]

_PENDING: list[AsyncSave] = []  # this process's asynchronous saves, oldest first
_GROUP: list[dist.ProcessGroup] = []  # the long-lived writer group (at most one)


def _live(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` still exists (not freed with its world)."""
    return group in getattr(dist.distributed_c10d._world, "pg_map", {group: None})


def writer_group() -> dist.ProcessGroup | None:
    """The writer group (made on first use: collective over the world), or ``None`` in
    one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if _GROUP and not _live(_GROUP[0]):
        _GROUP.clear()
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def release_group() -> None:
    """Wait for the pending saves, then free the writer group (local: gloo)."""
    finish_pending()
    if _GROUP:
        group = _GROUP.pop()
        if dist.is_available() and dist.is_initialized() and _live(group):
            dist.destroy_process_group(group)


def finish_pending() -> None:
    """Wait until every earlier asynchronous save of this process is published (its
    error stays for its own ``wait()``): saves publish in the order they were made, and
    a save never deletes the staging directory of one still writing."""
    while _PENDING:
        _PENDING.pop(0)._thread.join()


class AsyncSave:
    """A save running in the background (``save(..., async_save=True)``).

    ``wait()`` blocks until the checkpoint is published (every rank) and re-raises its
    error if it failed; ``done()`` tells whether it finished. Not calling ``wait()`` is
    fine: the next ``save``/``load`` or ``close()`` waits for it (its error is then lost).
    """

    def __init__(self, path: str, work: Callable[[], None]) -> None:
        self.path = path
        self._error: BaseException | None = None
        _PENDING.append(self)
        self._thread = threading.Thread(
            target=self._run, args=(work,), name=f"mp_bridge-save:{path}", daemon=True
        )
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self in _PENDING:
            _PENDING.remove(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
