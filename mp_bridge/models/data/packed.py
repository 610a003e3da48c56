"""Packed (THD) text for the MIMO models: documents back to back, ``cu_seqlens`` bounds.

A packed batch concatenates its documents' tokens into 1-D ``input_ids``, ``labels``,
``loss_mask`` ``[T]``; ``cu_seqlens`` ``[0, l0, l0+l1, ..., T]`` (``B + 1`` entries) bounds
them. Document ``i`` is sample ``i``: its placeholders take sample ``i``'s image tokens.
Lengths are free (odd, different; even 0): the model pads each document to its CP cut
internally (:class:`~mp_bridge.comm.PartitionAdapter`). Example: lengths ``[5, 3]`` give
``cu_seqlens = [0, 5, 8]``; with ``input_ids = [a, I, I, b, c, | I, d, e]`` the per-document
placeholder counts are ``[2, 1]``.

Pure torch, no collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_bridge.comm import normalize_cu_seqlens, sample_sums

__all__ = [
    "check_cu_seqlens",
    "document_sums",
    "placeholder_counts",
    "rows_per_document",
]

CuSeqlens = Sequence[int] | torch.Tensor


def check_cu_seqlens(cu_seqlens: object, total: int) -> torch.Tensor:
    """``cu_seqlens`` as a CPU int64 tensor ``[B + 1]`` if it bounds ``total`` packed tokens.

    Valid: 1-D integers, starting at 0, non-decreasing, ending at ``total``; otherwise a
    ``ValueError``/``TypeError`` naming the value and the fix.
    """
    if not isinstance(cu_seqlens, torch.Tensor | Sequence):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor or a list of ints, got "
            f"{type(cu_seqlens).__name__}; e.g. [0, 5, 8] for documents of 5 and 3 tokens"
        )
    values = normalize_cu_seqlens(cu_seqlens, 1)
    if values[-1] != total:
        raise ValueError(
            f"cu_seqlens={values} ends at {values[-1]} but the packed tensors hold {total} "
            f"tokens; the last entry must be the token count ({total})"
        )
    return torch.tensor(values, dtype=torch.int64)


def document_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-document sums ``[B]`` (int64, on ``values.device``) of 1-D ``values [T]``."""
    return sample_sums(values, cu_seqlens)


def placeholder_counts(
    input_ids: torch.Tensor, image_token_id: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """``[b]`` int64 image placeholders per sample (on ``input_ids.device``): per row of
    ``[b, S]`` ids, or per document of packed ``[T]`` ids with ``cu_seqlens``."""
    return sample_sums(input_ids == image_token_id, cu_seqlens)


def rows_per_document(image: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Flat ``[sum(counts), h]``: the first ``counts[i]`` rows of uniform ``image [b, p, h]``'s
    sample ``i``, in sample order (the rows a packed batch or the routed flow places; unused
    patch rows are left out and get a zero gradient)."""
    keep = torch.arange(image.shape[1], device=counts.device)[None, :] < counts[:, None]
    return image[keep.to(image.device)]
