"""``save``: one checkpoint of a model (and optimizer, RNG, stateful objects) at a path.

Collective over every rank of the world (each rank holds part of the model; a pipeline
stage only its own layers). Steps, each a function:

1. check and collect (:func:`_collect`): the arguments and this rank's entries
   (:mod:`.entries`); errors are agreed (:func:`.ranks.agree_on_errors`): a parameter one
   rank refuses is the same ``ValueError`` on every rank, before anything is written;
2. describe (:func:`_describe`): every sharded parameter's group size (one gather) and
   the model's own grids (:func:`_declared_grids`) go into ``mp_bridge.json``;
3. write (:func:`_write`): DCP writes every global tensor once (:mod:`.dcp_adapter`:
   pieces of the unpadded tensor; replicas de-duplicated) into a staging directory beside
   ``path``; the coordinator writes ``mp_bridge.json`` and publishes (:mod:`.publish`).

``save`` never changes the run it saves: it reads parameters and ``optimizer.state`` as
they are (it does not use DCP's ``get_optimizer_state_dict``, which initializes an empty
optimizer's state by stepping it) and only reads the RNG states.

With ``async_save=True`` steps 1 and 2 and the staging of every tensor into the model's
reused CPU buffers (:mod:`.staging`) run in the caller; step 3 runs in a background
thread over the one long-lived writer group (:mod:`.background`), and ``save`` returns an
:class:`~.background.AsyncSave`. A later ``save`` or ``load`` first waits for it to be
published. :func:`close` frees the writer group and the staging buffers.
"""

from __future__ import annotations

import atexit
import copy
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from mp_bridge.checkpoint import rng
from mp_bridge.checkpoint.arguments import check_common, check_extra
from mp_bridge.checkpoint.background import (
    AsyncSave,
    finish_pending,
    release_group,
    writer_group,
)
from mp_bridge.checkpoint.dcp_adapter import PiecesSavePlanner
from mp_bridge.checkpoint.entries import Entry, model_entries, optimizer_class, optimizer_entries
from mp_bridge.checkpoint.hf_record import hf_record
from mp_bridge.checkpoint.info import FORMAT_VERSION, CheckpointInfo, write_info
from mp_bridge.checkpoint.keys import MODEL, rng_key, stateful_key
from mp_bridge.checkpoint.locate import staging_dir
from mp_bridge.checkpoint.publish import check_target, clean_leftovers, publish
from mp_bridge.checkpoint.ranks import (
    DCP_ERRORS,
    agree_on_errors,
    broadcast,
    checkpoint_group,
    dcp_errors,
    dcp_quietly,
    gather,
    is_coordinator,
)
from mp_bridge.checkpoint.staging import drop_all, stage
from mp_bridge.comm import group_size
from mp_bridge.grid import GridLayout

__all__ = ["close", "save"]


def _declared_grids(model: nn.Module) -> dict[str, dict]:
    """The grids ``model`` declares through ``model.checkpoint_grids()`` (``{part: a
    HyperCommGrid or None}``; a colocated MIMO model's are ``encoder`` and ``llm``), as
    JSON; ``{}`` for a model without the method."""
    declare = getattr(model, "checkpoint_grids", None)
    out = {}
    for part, grid in (declare() if callable(declare) else {}).items():
        if grid is not None:
            layout = GridLayout.from_grid(grid)
            out[part] = {
                "shape": list(layout.shape),
                "axis_names": list(layout.axis_names),
                "rank_offset": layout.rank_offset,
            }
    return out


def _collect(model, optimizer, stateful, rank: int) -> tuple[dict[str, Entry], dict[str, Any]]:
    """This rank's tensor entries (the model's, its HF untrained tensors, the optimizer's)
    and objects (RNG, optimizer groups, stateful states)."""
    entries = model_entries(model)
    _, untrained = hf_record(model)
    entries.update({k: Entry(k, t, None) for k, t in untrained.items()})
    objects: dict[str, Any] = {rng_key(rank): rng.capture()}
    if optimizer is not None:
        opt_entries, opt_objects = optimizer_entries(optimizer, model)
        entries.update(opt_entries)
        objects.update(opt_objects)
    for key, obj in (stateful or {}).items():
        objects[stateful_key(key, rank)] = obj.state_dict()
    return entries, objects


def _describe(model, optimizer, entries, step, extra, group) -> CheckpointInfo:
    """Step 2 (one gather): what ``mp_bridge.json`` says about this checkpoint."""
    sizes: dict[str, int] = {}
    for part in gather(
        {k[len(MODEL):]: group_size(e.spec.group) for k, e in entries.items()
         if e.spec is not None and k.startswith(MODEL)},
        group,
    ):  # fmt: skip
        sizes.update(part)
    return CheckpointInfo(
        step=step, extra=extra, format_version=FORMAT_VERSION,
        world_size=group_size(group), group_sizes=dict(sorted(sizes.items())),
        grids=_declared_grids(model), has_optimizer=optimizer is not None,
        optimizer="" if optimizer is None else optimizer_class(optimizer),
        hf_config=hf_record(model)[0],
    )  # fmt: skip


def _dcp_state(entries: dict[str, Entry], locals_: dict[str, torch.Tensor], objects) -> dict:
    """The flat state dict DCP writes: each entry over ``locals_[key]``, then the objects."""
    state: dict[str, Any] = {k: e.dcp_value(locals_[k]) for k, e in entries.items()}
    state.update(objects)
    return state


def _prepare_target(path: str, group) -> str:
    """This save's token (the coordinator's, on every rank), once the coordinator has
    checked ``path`` and cleaned what dead saves left beside it."""
    token = broadcast(uuid.uuid4().hex if is_coordinator(group) else None, group)
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
    agree_on_errors(error, group)
    return token


def _write(path: str, state: dict, info: CheckpointInfo, group) -> None:
    """Step 3 (collective over ``group``): stage, write, publish."""
    token = _prepare_target(path, group)
    staging = staging_dir(path, token)
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


def _start_async(path, model, entries, objects, info) -> AsyncSave:
    """Stage (in the caller), then write and publish in the background."""
    staged, ready = stage(model, {k: e.local for k, e in entries.items()})
    state = _dcp_state(entries, staged, copy.deepcopy(objects))
    group = writer_group()  # collective on first use only, in the caller

    def work() -> None:
        if ready is not None:
            ready.synchronize()
        _write(path, state, info, group)

    return AsyncSave(path, work)


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
    rank's RNG states are saved too. A model loaded with ``load_hf`` keeps its HF config
    and untrained tensors in the checkpoint (:mod:`.hf_record`). A checkpoint already at
    ``path`` is replaced atomically: it stays whole until the new one is published.

    Returns ``None`` once published, or with ``async_save=True`` an
    :class:`~mp_bridge.checkpoint.AsyncSave` whose ``wait()`` returns once published
    (see the module). An earlier asynchronous save still running is waited for first.
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
    agree_on_errors(error, group)
    info = _describe(model, optimizer, entries, step, extra, group)
    if async_save:
        return _start_async(path, model, entries, objects, info)
    locals_ = {k: e.local for k, e in entries.items()}
    _write(path, _dcp_state(entries, locals_, objects), info, group)
    return None


def close() -> None:
    """Wait for this process's asynchronous saves, then free the checkpoint's writer
    process group and every staging buffer. Not collective (each rank frees its own);
    the next asynchronous save makes them anew. Also run at interpreter exit."""
    release_group()
    drop_all()


atexit.register(close)
