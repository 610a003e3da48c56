"""``save``: one checkpoint of a model (and optimizer, RNG, stateful objects) at a path.

Collective over every rank of the world (each rank holds part of the model; a pipeline
stage only its own layers). Steps:

1. local: check the arguments and collect this rank's entries (:mod:`.entries`); the
   ranks exchange errors and layouts (two small gathers): a parameter one rank refuses
   is the same ``ValueError`` on every rank, before anything is written;
2. DCP writes every global tensor once (:mod:`.dcp_adapter`: pieces of the unpadded
   tensor; replicas de-duplicated) into a staging directory beside ``path``;
3. the coordinator writes ``mp_bridge.json`` and publishes (:mod:`.publish`); every rank
   returns once the checkpoint is published.

``save`` never changes the run it saves: it reads parameters and ``optimizer.state`` as
they are (it does not use DCP's ``get_optimizer_state_dict``, which initializes an empty
optimizer's state by stepping it) and only reads the RNG states.

With ``async_save=True`` step 1 and a copy of every tensor (to CPU) run in the caller;
steps 2 and 3 run in a background thread on a gloo process group of their own (made
here, collectively; freed by ``wait()``), and ``save`` returns an :class:`AsyncSave`. A later
``save`` or ``load`` first waits for it to be published (:func:`finish_pending`).
"""

from __future__ import annotations

import copy
import os
import threading
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from mp_bridge.checkpoint import rng
from mp_bridge.checkpoint.arguments import check_common, check_extra
from mp_bridge.checkpoint.dcp_adapter import PiecesSavePlanner
from mp_bridge.checkpoint.entries import (
    MODEL,
    Entry,
    model_entries,
    optimizer_class,
    optimizer_entries,
)
from mp_bridge.checkpoint.info import FORMAT_VERSION, CheckpointInfo, write_info
from mp_bridge.checkpoint.publish import check_target, clean_leftovers, publish, staging_dir
from mp_bridge.checkpoint.ranks import (
    DCP_ERRORS,
    agree_errors,
    broadcast,
    checkpoint_group,
    dcp_errors,
    dcp_quietly,
    gather,
    is_coordinator,
)
from mp_bridge.comm import group_size
from mp_bridge.grid import GridLayout

__all__ = ["AsyncSave", "finish_pending", "save"]

_PENDING: list[AsyncSave] = []  # this process's asynchronous saves, oldest first


def _grids(model: nn.Module) -> dict[str, dict]:
    """A colocated MIMO model's two grids (its public ``groups``), else ``{}``."""
    groups = getattr(model, "groups", None)
    out = {}
    for part in ("encoder", "llm"):
        grid = getattr(groups, f"{part}_grid", None)
        if grid is not None:
            layout = GridLayout.from_grid(grid)
            out[part] = {
                "shape": list(layout.shape),
                "axis_names": list(layout.axis_names),
                "rank_offset": layout.rank_offset,
            }
    return out


def _collect(model, optimizer, stateful, rank: int) -> tuple[dict[str, Entry], dict[str, Any]]:
    """This rank's tensor entries and objects (RNG, optimizer groups, stateful states)."""
    entries = model_entries(model)
    objects: dict[str, Any] = {f"rng.{rank}": rng.capture()}
    if optimizer is not None:
        opt_entries, opt_objects = optimizer_entries(optimizer, model)
        entries.update(opt_entries)
        objects.update(opt_objects)
    for key, obj in (stateful or {}).items():
        objects[f"stateful.{key}.{rank}"] = obj.state_dict()
    return entries, objects


def _dcp_state(entries: dict[str, Entry], objects: dict[str, Any], *, snapshot: bool) -> dict:
    """The flat state dict DCP writes; ``snapshot``: of CPU copies (nothing aliases the run)."""
    state: dict[str, Any] = {}
    for key, entry in entries.items():
        local = entry.local.detach().to("cpu", copy=True) if snapshot else entry.local
        state[key] = entry.dcp_value(local)
    state.update(copy.deepcopy(objects) if snapshot else objects)
    return state


def _write(path: str, state: dict, info: CheckpointInfo, group) -> None:
    """Steps 2 and 3 (collective over ``group``): stage, write, publish."""
    token = broadcast(uuid.uuid4().hex if is_coordinator(group) else None, group)
    staging = staging_dir(path, token)
    error = None
    if is_coordinator(group):
        try:
            check_target(path)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            clean_leftovers(path)
        except ValueError as exc:
            error = exc
        except OSError as exc:
            error = RuntimeError(f"cannot save a checkpoint at {path!r}: {exc}")
    agree_errors(error, group)
    try:
        with dcp_quietly():
            dcp.save(
                state, storage_writer=dcp.FileSystemWriter(staging),
                planner=PiecesSavePlanner(), process_group=group, no_dist=group is None,
            )  # fmt: skip
    except DCP_ERRORS as exc:  # DCP raises the same CheckpointException on every rank
        raise RuntimeError(f"saving the checkpoint at {path!r} failed: {dcp_errors(exc)}") from exc
    status = None
    if is_coordinator(group):
        try:
            write_info(staging, info)
            publish(staging, path, token)
        except Exception as exc:  # any error here must reach every rank (none may wait)
            status = f"publishing the checkpoint at {path!r} failed: {exc!r}"
    status = broadcast(status, group)
    if status is not None:
        raise RuntimeError(status)


def finish_pending() -> None:
    """Wait until every earlier asynchronous save of this process is published (its
    error stays for its own ``wait()``): saves publish in the order they were made, and
    a save never deletes the staging directory of one still writing."""
    while _PENDING:
        _PENDING.pop(0)._thread.join()


class AsyncSave:
    """A save running in the background (``save(..., async_save=True)``).

    ``wait()`` blocks until the checkpoint is published (every rank) and re-raises its
    error if it failed; ``done()`` tells whether it finished. Call ``wait()`` before the
    next save to the same path and before the process group is destroyed.
    """

    def __init__(self, path: str, state: dict, info: CheckpointInfo, group) -> None:
        self.path = path
        self._group = group
        self._error: BaseException | None = None
        _PENDING.append(self)
        self._thread = threading.Thread(
            target=self._run, args=(state, info), name=f"mp_bridge-save:{path}", daemon=True
        )
        self._thread.start()

    def _run(self, state: dict, info: CheckpointInfo) -> None:
        try:
            _write(self.path, state, info, self._group)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self in _PENDING:
            _PENDING.remove(self)
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int = 0,
    extra: Any = None,
    stateful: dict[str, Any] | None = None,
    async_save: bool = False,
) -> AsyncSave | None:
    """Write one checkpoint of ``model`` (and ``optimizer``) at the directory ``path``.

    Collective over every rank of the world. Every tensor is stored as its unpadded
    global tensor under its single-process name (``model.<name>``; optimizer state
    ``optim.<name>.<state>``), so :func:`~mp_bridge.checkpoint.load` reshards it to any
    layout. ``extra``: JSON values kept in the checkpoint; ``stateful``: ``{name: obj}``
    whose ``obj.state_dict()`` is saved per rank (an LR scheduler, a grad scaler); every
    rank's RNG states are saved too. A checkpoint already at ``path`` is replaced
    atomically: it stays whole until the new one is published.

    Returns ``None`` once published, or with ``async_save=True`` an :class:`AsyncSave`
    whose ``wait()`` returns once published (see the module). An earlier asynchronous
    save still running is waited for first.
    """
    finish_pending()
    group = checkpoint_group()
    rank = 0 if group is None else dist.get_rank(group)
    error, entries, objects = None, {}, {}
    try:  # local checks; a bad argument on one rank is the same error on every rank
        path = check_common(path, model, optimizer, stateful)
        check_extra(step, extra, async_save)
        entries, objects = _collect(model, optimizer, stateful, rank)
    except (ValueError, TypeError) as exc:
        error = exc
    agree_errors(error, group)
    sizes: dict[str, int] = {}
    for part in gather(
        {k[len(MODEL):]: group_size(e.spec.group) for k, e in entries.items()
         if e.spec is not None and k.startswith(MODEL)},
        group,
    ):  # fmt: skip
        sizes.update(part)
    info = CheckpointInfo(
        step=step, extra=extra, format_version=FORMAT_VERSION,
        world_size=group_size(group), group_sizes=dict(sorted(sizes.items())),
        grids=_grids(model), has_optimizer=optimizer is not None,
        optimizer="" if optimizer is None else optimizer_class(optimizer),
    )  # fmt: skip
    if not async_save:
        _write(path, _dcp_state(entries, objects, snapshot=False), info, group)
        return None
    state = _dcp_state(entries, objects, snapshot=True)
    # gloo: the snapshot is on the CPU, and the thread has no CUDA device of its own (an
    # NCCL group's object collectives there would all use cuda:0); DCP's own async_save
    # asks for a CPU backend too.
    own = None if group is None else dist.new_group(backend="gloo")
    return AsyncSave(path, state, info, own)
