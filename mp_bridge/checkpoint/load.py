"""``load``: fill a model (and optimizer, RNG, stateful objects) from a checkpoint, at
whatever layout the model was built with.

Collective over every rank of the world. Steps:

1. local: check the arguments, find the checkpoint (``mp_bridge.json``, file sizes,
   DCP's metadata) and this rank's entries; the ranks exchange errors (one gather);
2. the whole-model check: the union of every rank's keys and global shapes (one gather:
   a pipeline stage holds only its own layers) against the saved ones. A missing or
   unexpected key or another global shape is a ``ValueError`` naming the key with the
   saved and expected shapes, raised on every rank before any parameter changes (so
   are ranks whose models disagree on a key's global shape);
3. DCP reads each rank's pieces of every global tensor into fresh buffers (padding rows
   stay zero); a read error is the same error on every rank, with nothing changed yet;
4. the buffers are copied into the parameters, the optimizer state and hyper-parameters
   are set, then the RNG states (same rank in the saved world; whole-model loads only)
   and the ``stateful`` objects (this rank's saved state, else rank 0's).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from mp_bridge.checkpoint import rng
from mp_bridge.checkpoint.arguments import check_common, check_prefix
from mp_bridge.checkpoint.dcp_adapter import PiecesLoadPlanner
from mp_bridge.checkpoint.entries import (
    MODEL,
    OPTIM,
    OPTIM_GROUP,
    Entry,
    model_entries,
    optimizer_class,
    param_name,
    param_names,
)
from mp_bridge.checkpoint.info import CheckpointInfo, read_info
from mp_bridge.checkpoint.publish import resolve
from mp_bridge.checkpoint.ranks import (
    DCP_ERRORS,
    agree_errors,
    checkpoint_group,
    dcp_errors,
    dcp_quietly,
    gather,
)
from mp_bridge.checkpoint.save import finish_pending
from mp_bridge.layers import shard_spec

__all__ = ["load", "read_checkpoint"]

_SHOWN = 8  # keys listed in a mismatch error


def read_checkpoint(path: str) -> tuple[CheckpointInfo, Metadata]:
    """The info and DCP metadata of the checkpoint at ``path`` (no collective); errors
    name the path (missing, not a checkpoint, damaged)."""
    directory = resolve(path)
    info = read_info(directory)
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as exc:  # a truncated or corrupt .metadata: unpickling errors of any kind
        raise ValueError(
            f"damaged checkpoint at {path!r}: its DCP metadata is unreadable ({exc})"
        ) from exc
    return info, metadata


def _shape(metadata: Metadata, key: str) -> tuple[int, ...] | None:
    md = metadata.state_dict_metadata.get(key)
    return None if md is None or isinstance(md, BytesStorageMetadata) else tuple(md.size)


def _check_model(path: str, metadata: Metadata, ours: list[dict], prefix: str) -> None:
    """Step 2 on the gathered ``{key: global shape}`` of every rank (same on every rank)."""
    expected: dict[str, tuple[int, ...]] = {}
    for rank, part in enumerate(ours):
        for key, shape in part.items():
            if expected.setdefault(key, shape) != shape:
                first = next(r for r, p in enumerate(ours) if key in p)
                raise ValueError(
                    f"the ranks' models disagree on {key}: global shape {expected[key]} on "
                    f"rank {first}, {shape} on rank {rank}; build the same model on every rank"
                )
    saved = {
        k: _shape(metadata, k) for k in metadata.state_dict_metadata if k.startswith(MODEL + prefix)
    }
    problems = [
        f"{k}: saved {saved.get(k) or 'nothing'}, expected {expected.get(k) or 'nothing'}"
        for k in sorted(set(saved) | set(expected))
        if saved.get(k) != expected.get(k)
    ]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ValueError(
            f"checkpoint at {path!r} does not fit the model (global shapes): "
            + "; ".join(problems[:_SHOWN])
            + more
            + "; build the model with the saved sizes (vocab, hidden, layers), or pass "
            "prefix= to load one part of it"
        )


def _optimizer_targets(
    optimizer: torch.optim.Optimizer, model: nn.Module, prefix: str, metadata: Metadata
) -> tuple[dict[str, Entry], dict[str, Any], dict[str, tuple]]:
    """Fresh buffers for the saved optimizer state of this rank's parameters:
    ``(tensor entries, object placeholders, {key: (param, state name)})``."""
    names = param_names(model, prefix)
    saved = metadata.state_dict_metadata
    entries: dict[str, Entry] = {}
    objects: dict[str, Any] = {}
    where: dict[str, tuple] = {}
    for g, group in enumerate(optimizer.param_groups):
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            name = param_name(names, param, g)
            if OPTIM_GROUP + name in saved:
                objects[OPTIM_GROUP + name] = None
            head = f"{OPTIM}{name}."
            for key, md in saved.items():
                if not key.startswith(head) or "." in key[len(head) :]:
                    continue
                where[key] = (param, key[len(head) :])
                if isinstance(md, BytesStorageMetadata):
                    objects[key] = None
                    continue
                dtype = md.properties.dtype
                if len(md.size) == 0:
                    device = param.device if on_device else torch.device("cpu")
                    entries[key] = Entry(key, torch.zeros((), dtype=dtype, device=device), None)
                else:
                    spec = shard_spec(param)
                    entries[key] = Entry(key, torch.zeros_like(param, dtype=dtype), spec)
                    if tuple(md.size) != entries[key].global_shape:
                        raise ValueError(
                            f"checkpoint key {key}: saved global shape {tuple(md.size)}, "
                            f"expected {entries[key].global_shape} (the parameter's)"
                        )
    return entries, objects, where


def _apply_optimizer(optimizer, loaded: dict, where: dict[str, tuple], state: dict, names) -> None:
    """Step 4 for the optimizer: each parameter's loaded state (none when it had none at
    save), and each group's hyper-parameters from its first parameter's saved group."""
    by_param: dict[int, dict] = {}
    for key, (param, state_key) in where.items():
        by_param.setdefault(id(param), {})[state_key] = loaded[key]
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in by_param:
                optimizer.state[param] = by_param[id(param)]
            else:  # not stepped when saved: no state, as then
                optimizer.state.pop(param, None)
        hyper = next(
            (state[k] for p in group["params"] if (k := OPTIM_GROUP + names[id(p)]) in state),
            None,
        )
        if hyper is not None:
            group.update(hyper)


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    stateful: dict[str, Any] | None = None,
    prefix: str | None = None,
) -> CheckpointInfo:
    """Fill ``model`` (and ``optimizer``, ``stateful``) in place from the checkpoint at
    ``path``, at ``model``'s own layout; returns the checkpoint's :class:`CheckpointInfo`.

    Collective over every rank of the world (see the module for the steps and checks).
    ``prefix="llm."`` loads the saved ``llm.*`` part of a model into ``model`` (whose
    names then lack the prefix); RNG states are restored only without a prefix. A model-
    only load (``optimizer=None``) of a checkpoint with optimizer state is fine.
    """
    finish_pending()  # an asynchronous save still publishing (maybe at this path)
    group = checkpoint_group()
    rank = 0 if group is None else dist.get_rank(group)
    error = info = metadata = None
    entries: dict[str, Entry] = {}
    try:  # local checks; a bad argument on one rank is the same error on every rank
        path = check_common(path, model, optimizer, stateful)
        prefix = check_prefix(prefix)
        info, metadata = read_checkpoint(path)
        if optimizer is not None and not info.has_optimizer:
            raise ValueError(
                f"checkpoint at {path!r} holds no optimizer state; pass optimizer=None "
                f"(a model-only load) or a checkpoint saved with its optimizer"
            )
        if optimizer is not None and info.optimizer not in ("", optimizer_class(optimizer)):
            raise ValueError(
                f"checkpoint at {path!r} holds the state of a {info.optimizer}, not of "
                f"optimizer={optimizer_class(optimizer)}; pass a {info.optimizer}, or "
                f"optimizer=None to load the model alone (the new optimizer starts fresh)"
            )
        entries = model_entries(model, prefix)
    except (ValueError, TypeError, OSError) as exc:
        error = exc
    agree_errors(error, group)
    ours = {k: e.global_shape for k, e in entries.items()}
    error = None
    try:
        _check_model(path, metadata, gather(ours, group), prefix)
    except ValueError as exc:
        error = exc
    if error is not None:  # the same on every rank: each checked the same gathered keys
        raise error
    error, objects, where = None, {}, {}
    try:
        if optimizer is not None:
            opt_entries, objects, where = _optimizer_targets(optimizer, model, prefix, metadata)
            entries = {**entries, **opt_entries}
        saved = metadata.state_dict_metadata
        if not prefix and f"rng.{rank}" in saved:
            objects[f"rng.{rank}"] = None
        for key in stateful or {}:
            found = [k for k in (f"stateful.{key}.{rank}", f"stateful.{key}.0") if k in saved]
            if not found:
                raise ValueError(f"checkpoint at {path!r} holds no stateful object {key!r}")
            objects[found[0]] = None
    except ValueError as exc:
        error = exc
    agree_errors(error, group)
    buffers = {k: torch.zeros_like(e.local) for k, e in entries.items()}
    state: dict[str, Any] = {k: entries[k].dcp_value(buffers[k]) for k in entries}
    state.update(objects)
    try:
        with dcp_quietly():
            dcp.load(
                state, storage_reader=dcp.FileSystemReader(info.path),
                planner=PiecesLoadPlanner(), process_group=group, no_dist=group is None,
            )  # fmt: skip
    except DCP_ERRORS as exc:  # DCP raises the same CheckpointException on every rank
        raise RuntimeError(
            f"damaged checkpoint at {path!r}: reading it failed ({dcp_errors(exc)})"
        ) from exc
    # the user's objects first: one whose load_state_dict raises leaves the model, the
    # optimizer and the RNGs as they were
    for key, obj in (stateful or {}).items():
        mine = f"stateful.{key}.{rank}"
        obj.load_state_dict(state[mine if mine in state else f"stateful.{key}.0"])
    with torch.no_grad():
        for key, entry in entries.items():
            if key.startswith(MODEL):
                entry.local.copy_(buffers[key])
    if optimizer is not None:
        loaded = {k: buffers.get(k, state[k]) for k in where}
        _apply_optimizer(optimizer, loaded, where, state, param_names(model, prefix))
    if state.get(f"rng.{rank}") is not None:
        rng.restore(state[f"rng.{rank}"])
    return info
