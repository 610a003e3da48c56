"""Which (local query, gathered key) pairs of a packed CP batch share a sequence (pure).

With packed (THD) input, CP rank ``r`` holds the tokens ``cp_shard_indices_packed(cu, cp,
r)`` and, after the K/V all-gather, every key in the order ``cp_gather_order(S, cp,
cu_seqlens=cu)``. Attention must not cross sequences, so a query sees a key only when
both belong to the same packed sequence.

Example, ``cu_seqlens=[0, 4, 8]``, ``cp=2``, rank 0 holds tokens ``[0, 3, 4, 7]`` and the
keys arrive as ``[0, 3, 4, 7, 1, 2, 5, 6]`` (sequences ``[0, 0, 1, 1, 0, 0, 1, 1]``)::

    query 0 (seq 0) -> [1, 1, 0, 0, 1, 1, 0, 0]
    query 4 (seq 1) -> [0, 0, 1, 1, 0, 0, 1, 1]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_bridge.comm.sequence.cut import (
    gather_order_of_bounds,
    normalize_cu_seqlens,
    seq_len_divisor,
    shard_indices_of_bounds,
)
from mp_bridge.comm.sequence.padding import PaddedLayout

__all__ = ["packed_sequence_mask"]


def packed_sequence_mask(
    cu_seqlens: PaddedLayout | Sequence[int] | torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool ``[S / cp, S]``: ``True`` where local query ``i`` and gathered key ``j`` share a
    sequence.

    Rows follow the local token order (``cp_shard_indices_packed``), columns the gathered
    key order (``cp_gather_order``); ``S = cu_seqlens[-1]``, which must equal ``seq_len``
    when given. Every sequence length must be divisible by ``seq_len_divisor(cp_size)``.
    ``cu_seqlens`` may be a packed :class:`PaddedLayout` (``ShardedBatch.layout``): its
    padded bounds are used without parsing them again, and the mask is cached on it.
    """
    if isinstance(cu_seqlens, PaddedLayout):
        layout = cu_seqlens
        if not layout.packed or layout.cp != cp_size:
            raise ValueError(
                f"{layout!r} is not a packed layout cut for cp_size={cp_size}; pass the "
                f"ShardedBatch.layout of a packed batch sharded over this CP group"
            )
        if seq_len is not None and seq_len != layout.padded_len:
            raise ValueError(
                f"the layout holds {layout.padded_len} tokens but seq_len={seq_len}; pass the "
                f"layout of this batch"
            )
        bounds = list(layout.padded_bounds)
        key = ("mask", cp_rank, str(device))
        return layout.cached(key, lambda: _mask(bounds, cp_size, cp_rank).to(device))
    bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(cp_size), total=seq_len)
    return _mask(bounds, cp_size, cp_rank).to(device)


def _mask(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    lengths = torch.tensor([e - a for a, e in zip(bounds[:-1], bounds[1:])])
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    q_seq = seq_of[shard_indices_of_bounds(bounds, cp_size, cp_rank)]
    k_seq = seq_of[gather_order_of_bounds(bounds, cp_size)]
    return q_seq[:, None] == k_seq[None, :]
