"""Per-sample sums of per-token values: the one count of placeholders per sample.

A plain batch ``[B, S]`` sums each row; a packed batch ``[T]`` sums each document between
consecutive ``cu_seqlens`` bounds (document ``i`` is sample ``i``). The image placeholders
of each sample (``input_ids == image_token_id``) and the ``True`` entries of an
``image_mask`` are both counted here. Example: ``values = [0, 1, 1, 0, 0, | 1, 0, 0]``,
``cu_seqlens = [0, 5, 8]`` gives ``[2, 1]``. Pure torch, no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_bridge.comm.sequence.padding import PaddedLayout

__all__ = ["sample_sums"]


def sample_sums(
    values: torch.Tensor, cu_seqlens: PaddedLayout | Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Int64 ``[B]`` on ``values.device``: the sum of each row of ``[B, S]`` ``values``, or
    of each document of packed ``[T]`` ``values`` bounded by ``cu_seqlens``.

    ``cu_seqlens``: the (already validated) original bounds, as a 1-D integer tensor, a
    list, or a :class:`PaddedLayout` (its ``bounds``; a plain layout means rows).
    Bool values count their ``True`` entries.
    """
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if isinstance(cu_seqlens, PaddedLayout):
        cu_seqlens = cu_seqlens.bounds
    if cu_seqlens is None:
        if values.dim() != 2:
            raise ValueError(f"values has shape {tuple(values.shape)}; expected [B, S] rows")
        return values.sum(1, dtype=torch.int64)
    ends = torch.cat(
        [values.new_zeros(1, dtype=torch.int64), values.reshape(-1).to(torch.int64).cumsum(0)]
    )
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=ends.device)
    return ends[cu[1:]] - ends[cu[:-1]]
