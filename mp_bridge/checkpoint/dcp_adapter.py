"""How a sharded parameter looks to ``torch.distributed.checkpoint`` (DCP): its pieces.

DCP stores a tensor as chunks of its *global* tensor (offsets + sizes) and reshards at
load by intersecting the saved chunks with the chunks each rank asks for. DTensor and
ShardedTensor describe their chunks that way, but neither can say "rows ``[753, 1001)`` of
a ``[1001, H]`` tensor live in the first 248 rows of my ``[251, H]`` padded shard", nor
"my ``[gate_r; up_r]`` rows are two chunks far apart" (DTensor's uneven ``Shard`` is
``torch.chunk``'s split, not Megatron's padded one). So a sharded tensor enters DCP as a
:class:`PiecesTensor`: the local tensor plus the :class:`~mp_bridge.layers.ShardPiece` s
that :meth:`ShardSpec.pieces` computes, through DCP's duck-typed hooks
(``__create_write_items__`` / ``__create_chunk_list__``), one chunk per piece. Padding rows
are in no piece: they never reach the disk and are never written at load.

DCP looks a chunk up by its global offset only for tensors (``find_state_dict_object``),
so two small planners (:class:`PiecesSavePlanner`, :class:`PiecesLoadPlanner`) look up
a :class:`PiecesTensor`'s piece themselves. Replicated tensors are plain tensors: every
rank offers them and DCP's plan de-duplication writes each once (so do DP replicas of a
piece, which share its global offset).

Example: vocab 1001 on TP 4, local ``[251, 8]``: rank 3's one chunk is offsets
``(753, 0)``, sizes ``(248, 8)`` of global size ``(1001, 8)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from mp_bridge.layers import ShardPiece

__all__ = ["PiecesLoadPlanner", "PiecesSavePlanner", "PiecesTensor"]


class PiecesTensor:
    """The real rows of ``local`` (split along ``dim``) as chunks of a ``global_shape`` tensor.

    ``local``: the rank's tensor (padding included); ``pieces``: which local rows are which
    global rows; ``offsets``: where ``local`` starts in the global tensor along the other
    dims (default zeros; an FSDP2 ``DTensor`` shard's offsets, from DCP's own chunk of it).
    Writing reads the pieces out of ``local``; loading writes into them (the rest of
    ``local`` is left as it is).
    """

    def __init__(
        self,
        local: torch.Tensor,
        global_shape: Sequence[int],
        dim: int,
        pieces: Sequence[ShardPiece],
        offsets: Sequence[int] | None = None,
    ):
        self.local, self.dim = local, dim
        self.global_shape = torch.Size(global_shape)
        self._views: dict[torch.Size, torch.Tensor] = {}
        self._chunks: list[ChunkStorageMetadata] = []
        self._rows = [(piece.local_start, piece.length) for piece in pieces]
        for piece in pieces:
            start = list(offsets) if offsets is not None else [0] * local.dim()
            start[dim] = piece.full_start
            view = local.narrow(dim, piece.local_start, piece.length)
            self._views[torch.Size(start)] = view
            self._chunks.append(ChunkStorageMetadata(torch.Size(start), view.shape))

    def zero_rest(self) -> None:
        """Zero the rows of ``local`` along ``dim`` that no piece covers (padding): a load
        reads into uninitialized buffers, and only the pieces are read."""
        start = 0
        for begin, length in sorted(self._rows):
            if begin > start:
                self.local.narrow(self.dim, start, begin - start).zero_()
            start = max(start, begin + length)
        if start < self.local.shape[self.dim]:
            self.local.narrow(self.dim, start, self.local.shape[self.dim] - start).zero_()

    def size(self) -> torch.Size:
        """The global shape (what DCP checks against the saved metadata)."""
        return self.global_shape

    def piece_at(self, offsets: torch.Size) -> torch.Tensor:
        """The local view of the piece starting at global ``offsets``."""
        return self._views[torch.Size(offsets)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=properties, size=self.global_shape
                ),
            )  # fmt: skip
            for chunk in self._chunks
        ]


def _lookup(state_dict: dict, index: MetadataIndex, default):
    obj = state_dict.get(index.fqn)
    if isinstance(obj, PiecesTensor):
        return obj.piece_at(index.offset)
    return default(index)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner (flat state dict, replicas de-duplicated) that also
    resolves a :class:`PiecesTensor`'s chunks."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        return _lookup(self.state_dict, index, super().lookup_object)


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (flat state dict, every key must be saved) that also
    loads into a :class:`PiecesTensor`'s chunks."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner first runs DCP's meta-tensor initializer over the state
        # dict, which replaces any value it does not know (a PiecesTensor) by None. Our
        # buffers are never meta tensors: keep the dict as it is.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, super().lookup_tensor)
