"""A ``DTensor`` weight at the fused loss doors: vocab parallelism only where it is declared.

``fused_linear_cross_entropy`` / ``fused_linear_logprobs`` call :func:`local_operands`
first, with their arguments by name. A plain ``weight`` passes through unchanged. A ``DTensor``
weight ``[V, H]`` is vocab-parallel only when it is ``Shard(0)`` over the mesh dim named
``"tp"`` (torchtitan's name) or named by the door's ``vocab_mesh_dim=``, and
``Replicate`` over every other mesh dim; then:

- the TP group is that mesh dim's group (a ``tp_group`` with other ranks: ``ValueError``);
- ``vocab_size`` is the global row count ``V`` (another value: ``ValueError``);
- the shards are taken as ``distribute_tensor`` makes them (``torch.chunk``: ``c =
  ceil(V / tp)`` rows per rank, the last ones short or empty, e.g. V = 5 at TP 4 gives 2,
  2, 1, 0): the padded layout of ``vocab_shards`` with ``multiple=1``, each rank holding
  only its real rows. The engines get ``weight.to_local()`` (no copy, no padding) and
  ``shard_rows = c``, the layout's rows per rank, the same on every rank: what the ranks
  agree on as ``weight.shape`` and what every per-chunk choice is made from, so the
  ranks issue the same collectives whatever their rows;
- ``to_local``'s backward makes the weight's gradient a ``DTensor`` of its placements.

Every other ``DTensor`` weight is refused, by a ``ValueError`` naming its placements and
mesh, before any collective: a mesh without the named dim (an unnamed or data-parallel
mesh: FSDP2's weight outside its unit's ``forward`` looks exactly like a TP one, and TP
over ranks that hold different tokens would be silently wrong), a shard over another
mesh dim too, and on the vocab dim anything but ``Shard(0)`` (``Partial``, ``Shard(1)``,
``Replicate``). ``invariant=True`` needs every shard to start on a ``VOCAB_BLOCK``-row
block (``c`` a multiple of 256 at TP > 1; the last shard may be short), else a
``ValueError`` naming the shard sizes.

A ``DTensor`` ``hidden`` (torchtitan's final norm under sequence parallelism is
``Shard(1)`` over ``"tp"``) must be on the weight's mesh: it is **redistributed** to the
tokens replicated over the vocab dim, one all-gather (none when already ``Replicate``),
and its other mesh dims keep their token sharding; its gradient comes back with its own
placements (no collective: every TP rank holds the whole ``d hidden``). ``Partial`` or a
shard of the hidden dim ``H`` is refused by name. A ``DTensor`` ``target`` or
``temperature``, or a ``DTensor`` ``hidden`` with a plain weight, is refused: pass plain
tensors of the local tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK

__all__ = ["VOCAB_MESH_DIM", "LocalOperands", "chunk_rows", "local_operands"]

#: The mesh dim a ``Shard(0)`` weight is vocab-parallel over without ``vocab_mesh_dim=``.
VOCAB_MESH_DIM = "tp"

_FSDP_FIX = (
    "an FSDP2 (fully_shard) weight outside its unit's forward looks like this: call the "
    "loss inside that FSDP unit's forward (where FSDP has gathered the weight), or pass "
    "weight.full_tensor()"
)


class LocalOperands(NamedTuple):
    """What the door hands its parse: plain tensors and the shard's declaration.

    ``shard_rows``: ``None`` for a plain weight (its rows are the shard's), else the padded
    layout's rows per rank ``c`` of a ``DTensor`` weight (this rank holds ``weight.shape[0]
    <= c`` of them)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    vocab_size: int | None
    shard_rows: int | None


def chunk_rows(vocab: int, tp: int) -> tuple[int, ...]:
    """Rows per rank of ``vocab`` rows split as ``torch.chunk`` (``distribute_tensor``'s
    ``Shard(0)``): ``chunk_rows(5, 4) == (2, 2, 1, 0)``."""
    c = -(-vocab // tp)
    return tuple(max(0, min(c, vocab - r * c)) for r in range(tp))


def _where(x: DTensor) -> str:
    return f"placements {tuple(x.placements)} on {x.device_mesh}"


def _refuse_plain_only(args: Mapping[str, object], names: tuple[str, ...], why: str) -> None:
    for name in names:
        if isinstance(args.get(name), DTensor):
            x = args[name]
            raise ValueError(
                f"{name} is a DTensor ({_where(x)}) {why}; pass a plain tensor of this "
                f"rank's tokens, e.g. {name}.full_tensor() (replicated tokens) or "
                f"{name}.to_local()"
            )


def _vocab_dim(weight: DTensor, mesh_dim: object) -> int:
    """The index of the declared vocab mesh dim of ``weight``, or the refusal."""
    if mesh_dim is not None and not isinstance(mesh_dim, str):
        raise TypeError(f"vocab_mesh_dim must be a mesh dim name (str) or None, got {mesh_dim!r}")
    names = weight.device_mesh.mesh_dim_names or ()
    name = VOCAB_MESH_DIM if mesh_dim is None else mesh_dim
    if name not in names:
        named = "unnamed" if not names else f"named {names}"
        asked = f"vocab_mesh_dim={mesh_dim!r}" if mesh_dim is not None else f"no {name!r} dim"
        raise ValueError(
            f"weight is a DTensor with {_where(weight)}, whose mesh is {named}: {asked}, so "
            f"it is not declared vocab-parallel and is refused (no TP over ranks that may "
            f"hold different tokens). {_FSDP_FIX}; for vocab parallelism shard it Shard(0) "
            f"over a mesh dim named {VOCAB_MESH_DIM!r} or pass vocab_mesh_dim=<its name>"
        )
    d = names.index(name)
    p = weight.placements[d]
    if type(p) is not Shard or p.dim != 0:
        raise ValueError(
            f"weight is a DTensor with {_where(weight)}: placement {p!r} on the vocab mesh "
            f"dim {name!r} cannot be used; accepted: Shard(dim=0) there (the vocab rows, "
            "as distribute_tensor(weight, mesh, [Shard(0)]) makes them) and Replicate() on "
            "every other mesh dim; or pass weight.full_tensor() with no tp_group"
        )
    placed = zip(names, weight.placements, strict=True)
    other = [f"{q!r} over mesh dim {n!r}" for n, q in placed if n != name and q != Replicate()]
    if not other:
        return d
    raise ValueError(
        f"weight is a DTensor with {_where(weight)}: {', '.join(other)} as well as Shard(0) "
        f"over {name!r}, which is not vocab parallelism and is refused; {_FSDP_FIX}"
    )


def _tp_group(weight: DTensor, d: int, tp_group: object) -> dist.ProcessGroup:
    group = weight.device_mesh.get_group(d)
    if tp_group is not None:
        if not isinstance(tp_group, dist.ProcessGroup):
            raise TypeError(f"tp_group must be a ProcessGroup or None, got {tp_group!r}")
        mine, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(tp_group)
        if mine != theirs:
            raise ValueError(
                f"tp_group holds ranks {theirs}, but the DTensor weight is vocab-parallel over "
                f"mesh dim {weight.device_mesh.mesh_dim_names[d]!r} of ranks {mine} "
                f"({_where(weight)}); pass tp_group=None (the group comes from the mesh)"
            )
    return group


def _local_hidden(hidden: DTensor, weight: DTensor, d: int) -> torch.Tensor:
    """``hidden``'s tokens replicated over mesh dim ``d`` (one collective at most)."""
    if hidden.device_mesh != weight.device_mesh:
        raise ValueError(
            f"hidden is a DTensor on {hidden.device_mesh}, the weight on "
            f"{weight.device_mesh}; put hidden on the weight's mesh, or pass a plain tensor "
            "of the tokens replicated over the vocab mesh dim"
        )
    for i, p in enumerate(hidden.placements):
        last = hidden.dim() - 1
        if p.is_partial() or (isinstance(p, Shard) and p.dim % hidden.dim() == last):
            raise ValueError(
                f"hidden is a DTensor with {_where(hidden)}: placement {p!r} on mesh dim "
                f"{hidden.device_mesh.mesh_dim_names[i]!r} cannot be used; accepted: "
                "Replicate() or Shard(d) of a token dim d (redistributed to the tokens "
                "replicated over the vocab dim, one all-gather); reduce it first, e.g. "
                "hidden.redistribute(placements=[Replicate()]), or pass a plain tensor"
            )
    placements = list(hidden.placements)
    placements[d] = Replicate()
    return hidden.redistribute(hidden.device_mesh, placements).to_local()


def local_operands(
    hidden: object,
    weight: object,
    *,
    target: object,
    temperature: object,
    tp_group: object,
    vocab_size: object,
    vocab_mesh_dim: object,
    invariant: object,
    ce_weight: object = None,
) -> LocalOperands:
    """The door's ``hidden``, ``weight``, ``tp_group``, ``vocab_size`` and ``shard_rows``
    for its parse (see the module docstring), from the door's arguments of those names.
    No collective except a ``DTensor`` ``hidden``'s redistribution, after every check."""
    mesh_dim = vocab_mesh_dim
    args = {"target": target, "temperature": temperature, "ce_weight": ce_weight}
    _refuse_plain_only(args, ("target", "temperature", "ce_weight"), "(the loss takes plain ones)")
    if not isinstance(weight, DTensor):
        _refuse_plain_only({"hidden": hidden}, ("hidden",), "but weight is not")
        if mesh_dim is not None:
            raise ValueError(
                f"vocab_mesh_dim={mesh_dim!r} names the vocab dim of a DTensor weight's "
                f"mesh, but weight is a plain tensor; drop it (pass tp_group= for a plain "
                "vocab shard)"
            )
        return LocalOperands(hidden, weight, tp_group, vocab_size, None)
    d = _vocab_dim(weight, mesh_dim)
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got a DTensor of shape {tuple(weight.shape)}")
    group = _tp_group(weight, d, tp_group)
    vocab, tp = weight.shape[0], weight.device_mesh.size(d)
    if vocab_size is not None and vocab_size != vocab:
        raise ValueError(
            f"vocab_size={vocab_size!r}, but the DTensor weight holds {vocab} vocab rows "
            f"({_where(weight)}); pass vocab_size=None (the global row count) or "
            f"vocab_size={vocab}"
        )
    rows = chunk_rows(vocab, tp)
    local = weight.to_local()
    rank = weight.device_mesh.get_local_rank(d)
    if local.shape[0] != rows[rank]:
        raise ValueError(
            f"the DTensor weight's local shard holds {local.shape[0]} rows on rank {rank} of "
            f"its vocab dim, but Shard(0) of {vocab} rows over {tp} ranks holds {rows} "
            "(torch.chunk); build it with distribute_tensor(weight, mesh, [Shard(0)])"
        )
    if invariant is True and tp > 1 and rows[0] % VOCAB_BLOCK:
        raise ValueError(
            f"invariant=True needs every vocab shard to start on a {VOCAB_BLOCK}-row block "
            f"(the last may be short), but the DTensor weight's shards hold {rows} rows "
            f"({vocab} rows over {tp} ranks, torch.chunk); pass invariant=False, or a "
            f"weight whose ceil(V / {tp}) is a multiple of {VOCAB_BLOCK} (V in "
            f"({(VOCAB_BLOCK - 1) * tp}, {VOCAB_BLOCK * tp}] at 256-row shards)"
        )
    if isinstance(hidden, DTensor):
        hidden = _local_hidden(hidden, weight, d)
    return LocalOperands(hidden, local, group, vocab, rows[0])
