"""Sharded-parameter declarations: the one mechanism that loads and gathers shards.

A parameter split over a group declares it once, where it is created, with
:func:`mark_sharded`: a :class:`ShardSpec` (the split tensor ``dim``, the ``group``, the
unpadded ``full_size`` along ``dim``) stored on the tensor. Everything that moves weights
between a full (single-process) tensor and the shards reads that declaration:
the layers' ``from_full`` and the models' ``load_full_state`` / ``gather_full_state``
(both call :func:`load_shard_` / :func:`gather_shard`). Unmarked parameters are replicated.

Layout: Megatron's contiguous rows. With local size ``n`` along ``dim``, rank ``r`` of the
group holds :class:`~mp_bridge.layers.VocabShard` ``[r * n, (r + 1) * n)`` of ``n * tp``
(padded) rows; rows at or past ``full_size`` are padding and hold zeros.

Fused parameters (``parts=k``): the full tensor is ``k`` equal parts stacked along ``dim``
(e.g. ``[gate; up]``), each split as above, and a rank holds its rows of every part, part
after part (``[gate_r; up_r]``): not contiguous rows of the full tensor. The one place that
maps local rows to full rows is :meth:`ShardSpec.pieces`.

Under FSDP2 (``fully_shard``) a parameter becomes a ``DTensor`` sharded over the
data-parallel mesh, whose global shape is the TP shard's: :class:`KeepsShardSpecs` (the
vocab layers' base) puts the declaration back on each parameter FSDP2 swaps in, and
:func:`gather_shard` / :func:`load_shard_` gather or keep the data-parallel chunk first.

Example (TP 2, a column-parallel ``[8, 4]`` weight, local ``[4, 4]``): rank 0 loads rows
0..3, rank 1 rows 4..7; :func:`gather_shard` all-gathers them back into ``[8, 4]``.
A vocab-1001 embedding on TP 4 (local ``[251, H]``): rank 3 holds rows ``[753, 1004)``,
loads the 248 real rows ``753..1000`` and keeps 3 zero padding rows.
A fused ``[gate; up]`` ``[8, 4]`` weight (``parts=2``) on TP 2: rank 0 holds full rows
``0, 1, 4, 5`` (gate rows 0..1, then up rows 0..1), rank 1 rows ``2, 3, 6, 7``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mp_bridge.checks import FrozenSpec, agree, agreed, check_group, check_int, check_tensor
from mp_bridge.comm import all_gather_tensor, group_rank, group_size
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = [
    "KeepsShardSpecs",
    "ShardPiece",
    "ShardSpec",
    "gather_shard",
    "load_shard_",
    "mark_sharded",
    "shard_of",
    "shard_spec",
]

#: The attribute a declaration lives in (read only through :func:`shard_spec`).
_SPEC_ATTR = "mp_shard"


@dataclass(frozen=True)
class ShardPiece:
    """``length`` real rows along the split dim: local rows ``[local_start, +length)`` are
    full rows ``[full_start, +length)``."""

    local_start: int
    full_start: int
    length: int


@dataclass(frozen=True)
class ShardSpec:
    """``dim``: the split tensor dim; ``group``: the split group (``None`` = one process);
    ``full_size``: the unpadded size along ``dim``; ``parts``: how many fused parts the
    full tensor stacks along ``dim`` (1: plain contiguous rows; see the module)."""

    dim: int
    group: dist.ProcessGroup | None
    full_size: int
    parts: int = 1

    def pieces(self, local_size: int, *, size: int, rank: int) -> tuple[ShardPiece, ...]:
        """The real rows rank ``rank`` of ``size`` holds, one piece per part (pure).

        E.g. ``ShardSpec(0, g, 1001).pieces(251, size=4, rank=3)`` ->
        ``(ShardPiece(0, 753, 248),)``; ``ShardSpec(0, g, 8, parts=2).pieces(4, size=2,
        rank=1)`` -> ``(ShardPiece(0, 2, 2), ShardPiece(2, 6, 2))``. Pieces with no real
        row (a rank holding only padding) are left out.
        """
        per_local, per_full = local_size // self.parts, self.full_size // self.parts
        out = []
        for j in range(self.parts):
            rows = VocabShard.of_rank(size, per_local, rank=rank, vocab_size=per_full)
            if rows.num_real:
                out.append(ShardPiece(j * per_local, j * per_full + rows.start, rows.num_real))
        return tuple(out)

    def local_pieces(self, local_size: int) -> tuple[ShardPiece, ...]:
        """:meth:`pieces` of this rank in ``group``."""
        return self.pieces(local_size, size=group_size(self.group), rank=group_rank(self.group))

    def rows(self, local_size: int) -> VocabShard:
        """This rank's rows along ``dim`` when each rank holds ``local_size`` of them."""
        return VocabShard.of_rank(
            group_size(self.group),
            local_size,
            rank=group_rank(self.group),
            vocab_size=self.full_size,
        )

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        """Shape of the full (unpadded) tensor whose shard has ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] = self.full_size
        return tuple(shape)


def mark_sharded(
    param: torch.Tensor,
    *,
    dim: int,
    group: dist.ProcessGroup | None,
    full_size: int,
    parts: int = 1,
) -> torch.Tensor:
    """Declare ``param`` split along ``dim`` over ``group`` (returns it, for chaining).

    ``full_size`` must fit the padded layout: ``full_size <= tp * param.shape[dim]``.
    ``parts > 1``: a fused parameter (``[gate_r; up_r]`` per rank, see the module); both
    ``full_size`` and ``param.shape[dim]`` must split into ``parts`` equal parts.
    """
    check_tensor("param", param)
    check_group("group", group)
    check_int("dim", dim)
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"dim={dim} is out of range for a parameter of shape {tuple(param.shape)}")
    dim %= param.dim()
    padded = group_size(group) * param.shape[dim]
    check_int("full_size", full_size)
    if not 0 < full_size <= padded:
        raise ValueError(
            f"full_size={full_size!r} does not fit {group_size(group)} shards of "
            f"{param.shape[dim]} along dim {dim}; use 0 < full_size <= {padded}"
        )
    check_int("parts", parts, low=1)
    if parts > 1 and (full_size % parts or param.shape[dim] % parts):
        raise ValueError(
            f"parts={parts} does not split full_size={full_size} and the local size "
            f"{param.shape[dim]} along dim {dim} into equal parts; pass the number of fused "
            f"parts that divides both (or parts=1)"
        )
    setattr(param, _SPEC_ATTR, ShardSpec(dim, group, full_size, parts))
    return param


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The declaration :func:`mark_sharded` stored on ``param`` (``None``: replicated)."""
    return getattr(param, _SPEC_ATTR, None)


class KeepsShardSpecs(nn.Module):
    """A module whose parameters keep their :class:`ShardSpec` when they are swapped.

    FSDP2's ``fully_shard`` replaces every parameter by a new one (the ``DTensor`` shard,
    and in forward the gathered tensor) and drops the declaration with the old one. It
    swaps them through ``setattr`` on a module that defines ``__setattr__``; here each
    declared parameter's spec is recorded by name, and a parameter that later takes that
    name without a declaration gets it back. E.g. ``VocabParallelEmbedding`` at TP 2 under
    FSDP2 over 2 data-parallel ranks: ``shard_spec(emb.weight)`` is still
    ``ShardSpec(0, tp_group, V)``, on a ``DTensor`` of global shape ``[V_local, H]``.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, nn.Parameter):
            kept = self.__dict__.setdefault("_kept_shard_specs", {})
            spec = shard_spec(value)
            if spec is None and name in kept:
                setattr(value, _SPEC_ATTR, kept[name])
            elif spec is not None:
                kept[name] = spec
        super().__setattr__(name, value)


def _data_parallel_full(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 ``DTensor`` parameter (or gradient) gathered over its data-parallel mesh:
    this rank's TP shard (collective: every rank of that mesh calls it); else ``tensor``."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_of(full: torch.Tensor, local_shape: torch.Size, spec: ShardSpec | None) -> torch.Tensor:
    """This rank's slice of ``full`` for a parameter of ``local_shape`` (zero-padded copy;
    ``full`` itself when ``spec`` is ``None``). No collective."""
    if spec is None:
        return full
    out = full.new_zeros(local_shape)
    for piece in spec.local_pieces(local_shape[spec.dim]):
        out.narrow(spec.dim, piece.local_start, piece.length).copy_(
            full.narrow(spec.dim, piece.full_start, piece.length)
        )
    return out


@torch.no_grad()
def load_shard_(param: torch.Tensor, full: torch.Tensor, *, name: str = "weight") -> None:
    """Copy this rank's shard of the full tensor ``full`` into ``param`` (in place).

    ``full`` must have the declared full shape (``param.shape`` if unmarked); it is cast
    to ``param``'s device and dtype. ``ValueError`` naming ``name`` otherwise. No collective.
    """
    spec = shard_spec(param)
    expected = tuple(param.shape) if spec is None else spec.full_shape(param.shape)
    if not isinstance(full, torch.Tensor) or tuple(full.shape) != expected:
        raise ValueError(
            f"{name}: full tensor has shape {tuple(getattr(full, 'shape', ()))}, expected "
            f"{expected} for this shard layout; pass the single-process tensor of that shape"
        )
    full = full.to(device=param.device, dtype=param.dtype)
    local = shard_of(full, param.shape, spec)
    if isinstance(param, DTensor):  # FSDP2: this rank's chunk of it, no collective
        local = distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(local)


@dataclass(frozen=True)
class _GatherSpec(FrozenSpec):
    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    full_size: int
    parts: int


@agreed("mp_bridge.layers.gather_shard")
@torch.no_grad()
def gather_shard(local: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """The full tensor of the shards ``local`` (padding dropped; a detached copy).

    Collective: one all-gather along ``spec.dim`` over ``spec.group`` (every member
    calls it, with the same local shape and dtype: agreed first); none when ``spec`` is
    ``None`` or the group has one rank. An FSDP2 ``DTensor`` is first gathered over its
    data-parallel mesh (one more all-gather, which every rank of that mesh calls).
    """
    check_tensor("local", local)
    local = _data_parallel_full(local)
    if spec is None:
        return local.detach().clone()
    if not isinstance(spec, ShardSpec):
        raise TypeError(f"spec must be a ShardSpec or None, got {type(spec).__name__}")
    parsed = _GatherSpec(tuple(local.shape), local.dtype, spec.dim, spec.full_size, spec.parts)
    agree("gather_shard", spec.group, parsed, device=local.device)
    gathered = all_gather_tensor(local.detach(), spec.group, spec.dim)
    if spec.parts == 1:
        return gathered.narrow(spec.dim, 0, spec.full_size).clone()
    n, size = local.shape[spec.dim], group_size(spec.group)
    out = local.new_empty(spec.full_shape(local.shape))
    for r in range(size):
        for piece in spec.pieces(n, size=size, rank=r):
            out.narrow(spec.dim, piece.full_start, piece.length).copy_(
                gathered.narrow(spec.dim, r * n + piece.local_start, piece.length)
            )
    return out
