"""What the ranks of a ``PartitionAdapter`` call compare before its first collective.

Each is parsed once from the call's validated arguments and passed to
:func:`mp_bridge.checks.agree` (``fields()`` are the compared values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PartitionShardSpec", "PartitionUnshardSpec"]


@dataclass(frozen=True)
class PartitionShardSpec:
    """``shard``: the full batch is the same on every CP (and SP) rank."""

    embeddings_shape: tuple[int, ...] | None
    embeddings_dtype: torch.dtype | None
    seq_len: int
    cu_seqlens: tuple[int, ...] | None
    given: tuple[tuple[str, bool], ...]

    def fields(self) -> dict[str, object]:
        return {
            "embeddings.shape": self.embeddings_shape,
            "embeddings.dtype": self.embeddings_dtype,
            "seq_len": self.seq_len,
            "cu_seqlens": self.cu_seqlens,
            "given": self.given,
        }


@dataclass(frozen=True)
class PartitionUnshardSpec:
    """``unshard``: every rank gathers the same shape, layout and adjoint."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    seq_dim: int
    sequence_parallel: bool
    grad: str
    seq_len: int | None
    cu_seqlens: tuple[int, ...] | None

    def fields(self) -> dict[str, object]:
        return {
            "x.shape": self.shape, "x.dtype": self.dtype, "seq_dim": self.seq_dim,
            "sequence_parallel": self.sequence_parallel, "grad": self.grad,
            "seq_len": self.seq_len, "cu_seqlens": self.cu_seqlens,
        }  # fmt: skip
