"""Where an FSDP2 / DTensor shard sits in its global tensor, read through DCP's own
DTensor support, and the pieces of a ``ShardSpec`` shard that such a shard holds.

A ``DTensor`` parameter (``fully_shard`` over ``"dp"``; or FSDP2 x DTensor TP on a
``("dp", "tp")`` mesh, ``(_StridedShard(0), Shard(0))``) tells DCP its one chunk
(``DTensor.__create_chunk_list__``: global offsets and sizes of ``to_local()``, however
the placements nest): :func:`place_of` keeps it, with the mesh, placements, global shape
and stride that :meth:`TensorPlace.rebuild` needs to make a ``DTensor`` again (resharded
optimizer state, before ``Optimizer.load_state_dict``).

Our ``ShardSpec`` TP inside FSDP's 1-D ``"dp"`` ``DTensor`` (``KeepsShardSpecs``): the
DTensor's global tensor is one *padded TP shard*, which DCP cannot express (its rows are
not rows of the unpadded full tensor). :func:`pieces_within` intersects the TP shard's
pieces with the rows this rank's DTensor chunk holds. E.g. vocab 11 at TP 2 (shard of 6
rows, TP rank 1's rows ``6..10`` plus one padding row) under FSDP over 2 ranks: dp rank 1
holds shard rows ``[3, 6)``, i.e. full rows ``9, 10`` in local rows ``0, 1`` (row 2 is
padding). No collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial

from mp_bridge.layers import ShardPiece

__all__ = ["TensorPlace", "pieces_within", "place_of"]


@dataclass(frozen=True)
class TensorPlace:
    """A ``DTensor``'s mesh, placements, global ``shape`` and ``stride``, and the global
    ``offsets`` of its local shard (whose sizes are ``to_local().shape``)."""

    mesh: object
    placements: tuple
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offsets: tuple[int, ...]

    def rebuild(self, local: torch.Tensor) -> DTensor:
        """A ``DTensor`` of this place over ``local`` (no collective, no copy)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape,
            stride=self.stride,
        )  # fmt: skip


def place_of(name: str, t: torch.Tensor) -> TensorPlace | None:
    """``t``'s place when it is a ``DTensor`` (``None``: a plain tensor). ``ValueError``
    naming ``name`` when its local shard is not one block of its global tensor (DCP's
    chunk differs from ``to_local()``) or it is ``Partial`` (not a value yet)."""
    if not isinstance(t, DTensor):
        return None
    local = t.to_local()
    chunks = t.__create_chunk_list__()
    if any(isinstance(p, Partial) for p in t.placements) or not (
        len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(local.shape)
    ):
        raise ValueError(
            f"parameter {name!r} is a DTensor with placements {t.placements} over "
            f"{t.device_mesh} whose local shard is not one block of its global tensor; "
            f"save it with Shard/_StridedShard/Replicate placements (fully_shard, "
            f"parallelize_module), or from gather_full_state(model)"
        )
    offsets = tuple(chunks[0].offsets)
    return TensorPlace(t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride(), offsets)


def pieces_within(pieces: Sequence[ShardPiece], start: int, length: int) -> tuple[ShardPiece, ...]:
    """The parts of ``pieces`` (local rows of a shard -> full rows) inside the shard rows
    ``[start, start + length)``, with local rows counted from ``start``."""
    out = []
    for p in pieces:
        lo, hi = max(p.local_start, start), min(p.local_start + p.length, start + length)
        if lo < hi:
            out.append(ShardPiece(lo - start, p.full_start + lo - p.local_start, hi - lo))
    return tuple(out)
