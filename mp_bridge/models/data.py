"""Seeded synthetic image + text batches and their DP shards (identical on every rank).

Sample ``i`` holds one image of ``num_patches`` patches and ``seq_len`` tokens; an image
sample has ``num_patches`` consecutive ``image_token_id`` placeholders at a random offset.
``loss_mask`` is 1 on text tokens and 0 on placeholders; ``uneven_mask`` additionally
drops a different random fraction of tokens per sample, so ranks hold different counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import MimoConfig

__all__ = ["MimoBatch", "dp_shard", "synthetic_batch"]


@dataclass(frozen=True)
class MimoBatch:
    """Global batch: ``images [B, p, patch_dim]``; ids, labels and ``loss_mask`` ``[B, S]``."""

    images: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> MimoBatch:
        return MimoBatch(*(t.to(device) for t in self.__dict__.values()))


def synthetic_batch(
    cfg: MimoConfig,
    batch_size: int,
    *,
    seed: int = 0,
    text_only: Sequence[int] = (),
    uneven_mask: bool = False,
) -> MimoBatch:
    """A deterministic global batch; samples listed in ``text_only`` get no image tokens."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    bad = [i for i in text_only if not 0 <= i < batch_size]
    if bad:
        raise ValueError(f"text_only={list(text_only)} has ids {bad} outside [0, {batch_size})")
    gen = torch.Generator().manual_seed(seed)
    b, s, p = batch_size, cfg.seq_len, cfg.num_patches
    images = torch.randn(b, p, cfg.patch_dim, generator=gen)
    # Text ids avoid the placeholder so only placed positions count as image tokens.
    ids = torch.randint(0, cfg.vocab_size - 1, (b, s), generator=gen)
    ids = torch.where(ids >= cfg.image_token_id, ids + 1, ids)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
    loss_mask = torch.ones(b, s)
    offsets = torch.randint(0, s - p + 1, (b,), generator=gen)
    for i in range(b):
        if i in text_only:
            continue
        start = int(offsets[i])
        ids[i, start : start + p] = cfg.image_token_id
        loss_mask[i, start : start + p] = 0.0
    if uneven_mask:
        keep = torch.rand(b, 1, generator=gen) * 0.8 + 0.1  # per-sample keep rate 10%..90%
        loss_mask = loss_mask * (torch.rand(b, s, generator=gen) < keep).float()
    return MimoBatch(images, ids, labels, loss_mask)


def dp_shard(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Contiguous batch block ``dp_rank`` of ``dp_size`` (the bridge's data contract)."""
    for name, value in (("dp_rank", dp_rank), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}); pass this rank's DP "
            "coordinate and the DP size"
        )
    if t.shape[0] % dp_size:
        raise ValueError(
            f"batch of {t.shape[0]} samples does not split over dp={dp_size}; use a batch "
            f"size that is a multiple of {dp_size}"
        )
    n = t.shape[0] // dp_size
    return t[dp_rank * n : (dp_rank + 1) * n]
