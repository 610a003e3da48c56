"""Ragged image tokens: every sample holds 0..n images, every image its own token count.

The tokens of a batch are one flat ``[T, patch_dim]`` tensor in sample order (sample 0's
images, then sample 1's, ...; inside a sample, its images in order). Two count tensors
describe it: ``tokens_per_image [N]`` (each >= 1) and ``images_per_sample [B]`` (each
>= 0; a text-only sample has 0). Example: ``images_per_sample = [2, 0, 1]`` and
``tokens_per_image = [3, 1, 2]`` give ``tokens_per_sample = [4, 0, 2]`` and ``T = 6``.
A DP shard is a contiguous block of samples, as for the uniform ``[B, p, patch_dim]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["RaggedImages"]


def _segment_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sums of consecutive runs of ``values`` of the given ``lengths`` (int64, CPU)."""
    ends = torch.cumsum(torch.cat([values.new_zeros(1), values]), 0)
    bounds = torch.cumsum(torch.cat([lengths.new_zeros(1), lengths]), 0)
    return ends[bounds[1:]] - ends[bounds[:-1]]


@dataclass(frozen=True)
class RaggedImages:
    """Flat image tokens ``[T, patch_dim]`` of a batch and their per-image/sample counts.

    ``tokens_per_image`` and ``images_per_sample`` are 1-D int64 CPU tensors (they steer
    slicing, never the math); checked on construction (``ValueError`` naming the fix).
    """

    tokens: torch.Tensor
    tokens_per_image: torch.Tensor
    images_per_sample: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("tokens_per_image", "images_per_sample"):
            t = torch.as_tensor(getattr(self, name))
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(
                    f"RaggedImages.{name} must be a 1-D integer tensor; got {t.dtype} "
                    f"of shape {tuple(t.shape)}"
                )
            object.__setattr__(self, name, t.to("cpu", torch.int64))
        if self.tokens.dim() != 2:
            raise ValueError(
                f"RaggedImages.tokens must be flat [T, patch_dim]; got shape "
                f"{tuple(self.tokens.shape)}; concatenate the images' tokens in sample order"
            )
        if bool((self.tokens_per_image < 1).any()) or bool((self.images_per_sample < 0).any()):
            raise ValueError(
                f"tokens_per_image={self.tokens_per_image.tolist()} must be >= 1 and "
                f"images_per_sample={self.images_per_sample.tolist()} >= 0; leave a "
                "text-only sample with 0 images instead of an empty image"
            )
        n_images, total = int(self.images_per_sample.sum()), int(self.tokens_per_image.sum())
        if n_images != len(self.tokens_per_image) or total != self.tokens.shape[0]:
            raise ValueError(
                f"images_per_sample sums to {n_images} images and tokens_per_image "
                f"({len(self.tokens_per_image)} images) to {total} tokens, but tokens holds "
                f"{self.tokens.shape[0]} rows; give one count per image and per sample"
            )

    @property
    def num_samples(self) -> int:
        return len(self.images_per_sample)

    @property
    def tokens_per_sample(self) -> torch.Tensor:
        """``[B]`` int64: the image tokens of each sample (0 for a text-only sample)."""
        return _segment_sums(self.tokens_per_image, self.images_per_sample)

    def image_index(self) -> torch.Tensor:
        """``[T]`` int64 on ``tokens.device``: which image (0..N-1) each token belongs to."""
        ids = torch.arange(len(self.tokens_per_image))
        return ids.repeat_interleave(self.tokens_per_image).to(self.tokens.device)

    def lengths(self) -> tuple[int, ...]:
        """Host ints: the token count of each image, in order (what attention keeps each
        image's tokens inside; ``image_attention`` takes it, no ``[T, T]`` mask)."""
        return tuple(int(n) for n in self.tokens_per_image.tolist())

    def token_slice(self, dp_rank: int, dp_size: int) -> slice:
        """Rows of ``tokens`` held by DP block ``dp_rank`` of ``dp_size`` (contiguous samples)."""
        if self.num_samples % dp_size:
            raise ValueError(
                f"batch of {self.num_samples} samples does not split over dp={dp_size}; use "
                f"a batch size that is a multiple of {dp_size}"
            )
        n = self.num_samples // dp_size
        counts = self.tokens_per_sample
        return slice(int(counts[: dp_rank * n].sum()), int(counts[: (dp_rank + 1) * n].sum()))

    def shard(self, dp_rank: int, dp_size: int) -> RaggedImages:
        """The samples of DP block ``dp_rank`` of ``dp_size`` (the bridge's data contract)."""
        rows = self.token_slice(dp_rank, dp_size)
        n = self.num_samples // dp_size
        per_sample = self.images_per_sample[dp_rank * n : (dp_rank + 1) * n]
        first = int(self.images_per_sample[: dp_rank * n].sum())
        sizes = self.tokens_per_image[first : first + int(per_sample.sum())]
        return RaggedImages(self.tokens[rows], sizes, per_sample)

    def with_tokens(self, tokens: torch.Tensor) -> RaggedImages:
        """The same counts over other rows (e.g. a ``requires_grad`` copy, or embeddings)."""
        return dataclasses.replace(self, tokens=tokens)

    def to(self, device: torch.device) -> RaggedImages:
        return self.with_tokens(self.tokens.to(device))
