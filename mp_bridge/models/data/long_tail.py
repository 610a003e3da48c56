"""Long-tailed image counts: the skew that balanced encoders exist for (pure, seeded).

Per sample: text-only with probability ``text_only``, else ``min(max_images,
⌊U^(−1/1.1)⌋)`` images (a Pareto(1.1) tail: most samples 1-2 images, a few many); per
image ``min(max_tokens, max(1, ⌊base·U^(−1/1.3)⌋))`` tokens (a Pareto(1.3) tail of sizes).
``U`` uniform on ``(0, 1]``, drawn from ``gen`` in a fixed order (two per sample, then
one per image of that sample), so a seed fixes the batch.
"""

from __future__ import annotations

import torch

from mp_bridge.checks import check_float, check_int

__all__ = ["long_tail_images"]


def long_tail_images(
    gen: torch.Generator,
    samples: int,
    *,
    max_images: int = 16,
    max_tokens: int = 4096,
    base: int = 64,
    text_only: float = 0.3,
) -> tuple[list[int], list[int]]:
    """``(images_per_sample [samples], tokens_per_image [N])`` drawn from ``gen``."""
    check_int("samples", samples, low=0)
    check_int("max_images", max_images, low=0)
    check_int("max_tokens", max_tokens, low=1)
    check_int("base", base, low=1)
    check_float("text_only", text_only, low=0.0, high=1.0)
    per_sample, sizes = [], []
    for _ in range(samples):
        u = torch.rand(2, generator=gen, dtype=torch.float64)
        n = 0 if u[0] < text_only else min(max_images, int(u[1] ** (-1 / 1.1)))
        v = torch.rand(n, generator=gen, dtype=torch.float64)
        per_sample.append(n)
        sizes += [min(max_tokens, max(1, int(base * x ** (-1 / 1.3)))) for x in v.tolist()]
    return per_sample, sizes
