"""``load``: fill a model (and optimizer, RNG, stateful objects) from a checkpoint, at
whatever layout the model was built with.

Collective over every rank of the world. Steps, each a function:

1. check (:func:`_check`, local): the arguments, the checkpoint (``mp_bridge.json``,
   file sizes, DCP's metadata) and this rank's model entries;
2. agree (:func:`_agree_on_model`, :func:`_targets`): errors are exchanged (every rank
   raises the same one); then the union of every rank's keys and global shapes (one
   gather: a pipeline stage holds only its own layers) is checked against the saved
   ones, on every rank alike: a missing or unexpected key or another global shape is a
   ``ValueError`` naming the key with the saved and expected shapes, raised before any
   parameter changes (so are ranks whose models disagree on a key's global shape); then
   the optimizer's, RNG's and stateful objects' targets;
3. read (:func:`_read`): DCP reads each rank's pieces of every global tensor into fresh
   uninitialized buffers, whose rows no piece covers (padding) are then zeroed; a read
   error is the same error on every rank, with nothing changed yet;
4. apply (:func:`_apply`): the stateful objects first (one that raises leaves the rest
   as it was), then the parameters, the optimizer through its own
   ``Optimizer.load_state_dict`` (state and each group's saved hyper-parameters), then
   the RNG states (same rank in the saved world; whole-model loads only), and a model
   loaded from HF gets its HF config and untrained tensors back (:mod:`.hf_record`;
   whole-model loads only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from mp_bridge.checkpoint import rng
from mp_bridge.checkpoint.arguments import check_common, check_prefix
from mp_bridge.checkpoint.background import finish_pending
from mp_bridge.checkpoint.dcp_adapter import PiecesLoadPlanner, PiecesTensor
from mp_bridge.checkpoint.entries import (
    Entry,
    entry_of,
    model_entries,
    optimizer_class,
    param_name,
    param_names,
)
from mp_bridge.checkpoint.hf_record import hf_targets, restore_hf
from mp_bridge.checkpoint.info import CheckpointInfo, read_checkpoint
from mp_bridge.checkpoint.keys import (
    MODEL,
    optim_group_key,
    optim_state_name,
    rng_key,
    stateful_key,
)
from mp_bridge.checkpoint.ranks import (
    DCP_ERRORS,
    agree_on_errors,
    checkpoint_group,
    dcp_errors,
    dcp_quietly,
    gather,
)
from mp_bridge.layers import shard_spec

__all__ = ["load", "read_checkpoint"]  # read_checkpoint: .info's, named here too

_SHOWN = 8  # keys listed in a mismatch error


@dataclass
class _Load:
    """One load's checked inputs and what it reads: ``entries`` (tensors: the model's,
    then the optimizer's), ``objects`` (keys of saved objects to read), ``where`` (an
    optimizer key -> its parameter and state name)."""

    path: str
    prefix: str
    info: CheckpointInfo
    metadata: Metadata
    rank: int
    entries: dict[str, Entry]
    objects: dict[str, Any] = field(default_factory=dict)
    where: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)


def _check(path, model, optimizer, stateful, prefix, rank: int) -> _Load:
    """Step 1 (local): the arguments, the checkpoint and this rank's model entries."""
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
    return _Load(path, prefix, info, metadata, rank, model_entries(model, prefix))


def _shape(metadata: Metadata, key: str) -> tuple[int, ...] | None:
    md = metadata.state_dict_metadata.get(key)
    return None if md is None or isinstance(md, BytesStorageMetadata) else tuple(md.size)


def _agree_on_model(job: _Load, group) -> None:
    """Step 2's whole-model check on every rank's ``{key: global shape}`` (one gather;
    every rank checks the same gathered keys, so raises the same error)."""
    ours = gather({k: e.global_shape for k, e in job.entries.items()}, group)
    expected: dict[str, tuple[int, ...]] = {}
    for rank, part in enumerate(ours):
        for key, shape in part.items():
            if expected.setdefault(key, shape) != shape:
                first = next(r for r, p in enumerate(ours) if key in p)
                raise ValueError(
                    f"the ranks' models disagree on {key}: global shape {expected[key]} on "
                    f"rank {first}, {shape} on rank {rank}; build the same model on every rank"
                )
    head = MODEL + job.prefix
    saved = {k: _shape(job.metadata, k) for k in job.metadata.state_dict_metadata}
    saved = {k: v for k, v in saved.items() if k.startswith(head)}
    problems = [
        f"{k}: saved {saved.get(k) or 'nothing'}, expected {expected.get(k) or 'nothing'}"
        for k in sorted(set(saved) | set(expected))
        if saved.get(k) != expected.get(k)
    ]
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise ValueError(
            f"checkpoint at {job.path!r} does not fit the model (global shapes): "
            + "; ".join(problems[:_SHOWN])
            + more
            + "; build the model with the saved sizes (vocab, hidden, layers), or pass "
            "prefix= to load one part of it"
        )


def _optimizer_targets(job: _Load, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Templates (uninitialized: :func:`_read` makes the buffers) for the saved optimizer
    state of this rank's parameters (a scalar on the CPU: ``load_state_dict`` moves it
    where the group wants it)."""
    names = param_names(model, job.prefix)
    saved = job.metadata.state_dict_metadata
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            name = param_name(names, param, g)
            if optim_group_key(name) in saved:
                job.objects[optim_group_key(name)] = None
            for key, md in saved.items():
                state_name = optim_state_name(key, name)
                if state_name is None:
                    continue
                job.where[key] = (param, state_name)
                if isinstance(md, BytesStorageMetadata):
                    job.objects[key] = None
                elif len(md.size) == 0:
                    job.entries[key] = Entry(key, torch.zeros((), dtype=md.properties.dtype), None)
                else:  # sharded like its parameter (a DTensor's: at its place)
                    held = entry_of(key, name, param, shard_spec(param))
                    like = torch.empty_like(held.local, dtype=md.properties.dtype)
                    job.entries[key] = entry = Entry(key, like, held.spec, held.place)
                    if tuple(md.size) != entry.global_shape:
                        raise ValueError(
                            f"checkpoint key {key}: saved global shape {tuple(md.size)}, "
                            f"expected {entry.global_shape} (the parameter's)"
                        )


def _targets(job: _Load, model, optimizer, stateful) -> None:
    """Step 2's targets (local): optimizer state, this rank's RNG, the stateful objects."""
    if optimizer is not None:
        _optimizer_targets(job, optimizer, model)
    saved = job.metadata.state_dict_metadata
    if not job.prefix and rng_key(job.rank) in saved:
        job.objects[rng_key(job.rank)] = None
    if not job.prefix and job.info.hf_config is not None:
        job.entries.update({k: Entry(k, t, None) for k, t in hf_targets(job.metadata).items()})
    for key in stateful or {}:
        found = [k for k in (stateful_key(key, job.rank), stateful_key(key, 0)) if k in saved]
        if not found:
            raise ValueError(f"checkpoint at {job.path!r} holds no stateful object {key!r}")
        job.objects[found[0]] = None


def _read(job: _Load, group) -> dict[str, Any]:
    """Step 3: every target read (tensors into fresh buffers; objects by value)."""
    buffers = {k: torch.empty_like(e.local) for k, e in job.entries.items()}
    state: dict[str, Any] = {k: job.entries[k].dcp_value(buffers[k]) for k in job.entries}
    state.update(job.objects)
    try:
        with dcp_quietly():
            dcp.load(
                state, storage_reader=dcp.FileSystemReader(job.info.path),
                planner=PiecesLoadPlanner(), process_group=group, no_dist=group is None,
            )  # fmt: skip
    except DCP_ERRORS as exc:  # DCP raises the same CheckpointException on every rank
        raise RuntimeError(
            f"damaged checkpoint at {job.path!r}: reading it failed ({dcp_errors(exc)})"
        ) from exc
    for value in state.values():
        if isinstance(value, PiecesTensor):
            value.zero_rest()
    return {**state, **buffers}


def _optimizer_state_dict(job: _Load, optimizer, model, read: dict) -> dict:
    """The loaded state in ``optimizer.state_dict()``'s own form: state by parameter
    index (none for a parameter that had none at save), each group's hyper-parameters
    from its first parameter's saved group (else the group's own)."""
    names = param_names(model, job.prefix)
    by_param: dict[int, dict] = {}
    for key, (param, state_name) in job.where.items():
        value = read[key]
        if key in job.entries:  # a DTensor parameter's state is a DTensor again
            value = job.entries[key].as_held(value)
        by_param.setdefault(id(param), {})[state_name] = value
    state: dict[int, dict] = {}
    groups = []
    index = 0  # state_dict()'s parameter numbering: across the groups, in order
    for group in optimizer.param_groups:
        ids, hyper = [], None
        for param in group["params"]:
            if id(param) in by_param:
                state[index] = by_param[id(param)]
            hyper = hyper or read.get(optim_group_key(names[id(param)]))
            ids.append(index)
            index += 1
        own = {k: v for k, v in group.items() if k != "params"}
        groups.append({**own, **(hyper or {}), "params": ids})
    return {"state": state, "param_groups": groups}


def _apply(job: _Load, model, optimizer, stateful, read: dict) -> None:
    """Step 4: stateful objects, parameters, optimizer, RNG (see the module)."""
    for key, obj in (stateful or {}).items():
        mine = stateful_key(key, job.rank)
        obj.load_state_dict(read[mine if mine in read else stateful_key(key, 0)])
    with torch.no_grad():
        for key, entry in job.entries.items():
            if key.startswith(MODEL):
                entry.local.copy_(read[key])
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state_dict(job, optimizer, model, read))
    if read.get(rng_key(job.rank)) is not None:
        rng.restore(read[rng_key(job.rank)])
    if not job.prefix:
        restore_hf(model, job.info.hf_config, read)


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
    job, error = None, None
    try:
        job = _check(path, model, optimizer, stateful, prefix, rank)
    except (ValueError, TypeError, OSError) as exc:
        error = exc
    agree_on_errors(error, group)
    _agree_on_model(job, group)
    try:
        _targets(job, model, optimizer, stateful)
    except ValueError as exc:
        error = exc
    agree_on_errors(error, group)
    _apply(job, model, optimizer, stateful, _read(job, group))
    return job.info
