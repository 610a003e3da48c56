"""What a model and its optimizer put in a checkpoint: one :class:`Entry` per global tensor.

Keys (the checkpoint's namespace, under the single-process parameter names; made by
:mod:`.keys`):

- ``model.<name>``: every parameter (``named_parameters``: a tied weight once, under its
  first name) and persistent buffer; its global tensor is the *unpadded* full tensor its
  ``ShardSpec`` declares (unmarked: replicated, the tensor itself);
- ``optim.<name>.<state>``: an optimizer state tensor; one of the parameter's shape is
  sharded like the parameter (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), a scalar
  (``step``) is replicated;
- ``optim_group.<name>``: the hyper-parameters of the parameter's group (``lr``, ...),
  an object.

A parameter that is tensor-parallel in megatron's own marking (``tensor_model_parallel``)
but declares no ``ShardSpec``, or whose megatron ``partition_stride`` is not 1 while it
declares plain contiguous rows, is refused by name: saving it as replicated or as
contiguous rows would write a wrong global tensor.

A ``DTensor`` parameter (FSDP2's ``fully_shard``, DTensor TP) is entered by its local
shard and its :class:`~.dtensor_place.TensorPlace`: its global tensor is the DTensor's
(DCP's own chunk of it), or, when it also declares a ``ShardSpec`` (our TP inside FSDP's
``"dp"`` DTensor), the unpadded full tensor of the spec, through the pieces its chunk
holds. Its optimizer state is entered the same way. No collective here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mp_bridge.checkpoint.dcp_adapter import PiecesTensor
from mp_bridge.checkpoint.dtensor_place import TensorPlace, pieces_within, place_of
from mp_bridge.checkpoint.keys import model_key, optim_group_key, optim_key
from mp_bridge.layers import ShardPiece, ShardSpec, shard_spec

__all__ = [
    "Entry",
    "entry_of",
    "model_entries",
    "optimizer_class",
    "optimizer_entries",
    "param_name",
    "param_names",
]


@dataclass(frozen=True)
class Entry:
    """One global tensor of the checkpoint as this rank holds it: ``local`` (a plain
    tensor: a DTensor's local shard), its ``spec`` (``None``: not ours to split) and its
    ``place`` (``None``: not a DTensor)."""

    key: str
    local: torch.Tensor
    spec: ShardSpec | None
    place: TensorPlace | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        shape = tuple(self.local.shape) if self.place is None else self.place.shape
        return shape if self.spec is None else self.spec.full_shape(shape)

    def dcp_value(self, local: torch.Tensor | None = None):
        """What DCP reads (save) or fills (load): ``local`` (default: this entry's) as a
        :class:`PiecesTensor` of the global tensor, or the plain tensor when replicated."""
        local = self.local if local is None else local
        if (self.spec is None and self.place is None) or local.dim() == 0:
            return local
        dim = 0 if self.spec is None else self.spec.dim
        offsets = (0,) * local.dim() if self.place is None else self.place.offsets
        rows = local.shape[dim] if self.place is None else self.place.shape[dim]
        pieces = (ShardPiece(0, 0, rows),) if self.spec is None else self.spec.local_pieces(rows)
        pieces = pieces_within(pieces, offsets[dim], local.shape[dim])
        return PiecesTensor(local, self.global_shape, dim, pieces, offsets)

    def as_held(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the model holds such a tensor (a DTensor at this entry's place)."""
        return local if self.place is None else self.place.rebuild(local)


def entry_of(key: str, name: str, tensor: torch.Tensor, spec: ShardSpec | None) -> Entry:
    """The entry of ``tensor`` (a plain tensor or a DTensor) under ``key``."""
    place = place_of(name, tensor)
    local = tensor.detach() if place is None else tensor.detach().to_local()
    return Entry(key, local, spec, place)


def _check_declared(name: str, param: torch.Tensor, spec: ShardSpec | None) -> None:
    if getattr(param, "tensor_model_parallel", False) and spec is None:
        raise ValueError(
            f"parameter {name!r} is tensor-parallel (megatron's tensor_model_parallel) but "
            f"declares no ShardSpec, so its global tensor is unknown; declare it where it is "
            f"created with mp_bridge.layers.mark_sharded(param, dim=, group=, full_size=)"
        )
    stride = getattr(param, "partition_stride", 1)
    if spec is not None and spec.parts == 1 and stride != 1:
        raise ValueError(
            f"parameter {name!r} has megatron partition_stride={stride}: its shard is not "
            f"contiguous rows of the full tensor; declare its layout with "
            f"mark_sharded(..., parts={stride}) (fused parts) or save it unfused"
        )


def param_names(model: nn.Module, prefix: str = "") -> dict[int, str]:
    """``id(param) -> prefix + name`` for every parameter of ``model`` (tied: first name)."""
    return {id(p): prefix + name for name, p in model.named_parameters()}


def param_name(names: dict[int, str], param: torch.Tensor, group: int) -> str:
    """``param``'s name in ``names`` (:func:`param_names`); ``ValueError`` for a parameter of
    ``optimizer.param_groups[group]`` that the model does not hold."""
    name = names.get(id(param))
    if name is None:
        raise ValueError(
            f"optimizer.param_groups[{group}] holds a parameter of shape {tuple(param.shape)} "
            f"that is not a parameter of the model; pass the optimizer built over "
            f"model.parameters()"
        )
    return name


def model_entries(model: nn.Module, prefix: str = "") -> dict[str, Entry]:
    """The ``model.`` entries of ``model``'s parameters and persistent buffers, named
    ``model.<prefix><name>``. ``ValueError`` naming a parameter whose layout is unknown."""
    out: dict[str, Entry] = {}
    persistent = set(model.state_dict(keep_vars=True))
    for name, param in model.named_parameters():
        spec = shard_spec(param)
        _check_declared(name, param, spec)
        key = model_key(prefix + name)
        out[key] = entry_of(key, name, param, spec)
    for name, buf in model.named_buffers():
        if name in persistent:
            key = model_key(prefix + name)
            out[key] = entry_of(key, name, buf, shard_spec(buf))
    return out


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """``module.QualName`` of ``optimizer``'s class, as a checkpoint records it (a load
    into another class is refused: its state names would not match)."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_entries(
    optimizer: torch.optim.Optimizer, model: nn.Module, prefix: str = ""
) -> tuple[dict[str, Entry], dict[str, object]]:
    """``(state entries, objects)`` of ``optimizer``: the objects are each parameter's group
    hyper-parameters (``optim_group.<name>``) and any non-tensor state value.

    Reads ``optimizer.state`` as it is (never steps or initializes it: a parameter with
    no state yet has no entry). ``ValueError`` naming a parameter that is not ``model``'s,
    or a state tensor that is neither of the parameter's shape nor a scalar.
    """
    names = param_names(model, prefix)
    entries: dict[str, Entry] = {}
    objects: dict[str, object] = {}
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for param in group["params"]:
            name = param_name(names, param, g)
            objects[optim_group_key(name)] = hyper
            for state_key, value in optimizer.state.get(param, {}).items():
                key = optim_key(name, state_key)
                if not isinstance(value, torch.Tensor):
                    objects[key] = value  # e.g. SGD's momentum_buffer None without momentum
                elif value.dim() == 0:
                    entries[key] = entry_of(key, name, value, None)  # replicated (step)
                elif value.shape == param.shape:
                    entries[key] = entry_of(key, name, value, shard_spec(param))
                else:
                    raise ValueError(
                        f"optimizer state {state_key!r} of parameter {name!r} has shape "
                        f"{tuple(value.shape)}, neither the parameter's "
                        f"{tuple(param.shape)} nor a scalar; such state (e.g. factored "
                        f"second moments) cannot be resharded: use Adam, AdamW or SGD"
                    )
    return entries, objects
