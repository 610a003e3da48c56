"""Bidirectional attention inside each image of a flat ragged batch, nothing ``[T, T]``.

``q, k, v [1, T, heads, d]`` hold the tokens of images of ``tokens_per_image`` tokens each,
image after image. Images of equal token counts are gathered into one ``[n, L, heads, d]``
batch and attended by one SDPA call (fused kernel: flash on CPU, flash / efficient on
CUDA), then written back in place order. Memory grows with ``T`` (one gathered copy of
each group), never with ``T²``; kernel launches = distinct token counts. No collective;
the backward is SDPA's (``index_select`` / ``index_copy`` adjoints move the gradients).
Grouped-query heads (``hq % hk == 0``) use SDPA's ``enable_gqa`` (no repeated K/V).
Example: ``tokens_per_image = (3, 1, 3)`` -> one call on images 0 and 2 (``[2, 3, h, d]``)
and one on image 1 (``[1, 1, h, d]``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["image_attention"]


def _groups(tokens_per_image: Sequence[int]) -> dict[int, list[int]]:
    """Token count -> the first token of every image of that count (host ints)."""
    starts: dict[int, list[int]] = defaultdict(list)
    at = 0
    for n in tokens_per_image:
        starts[int(n)].append(at)
        at += int(n)
    return starts


def image_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tokens_per_image: Sequence[int],
    *,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """``[1, T, hq, d]``: each token attends over the tokens of its own image only."""
    total = sum(int(n) for n in tokens_per_image)
    if q.shape[0] != 1 or q.shape[1] != total:
        raise ValueError(
            f"q has shape {tuple(q.shape)}; expected [1, T={total}, heads, d] for images of "
            f"{list(tokens_per_image)} tokens (one flat sequence, image after image)"
        )
    out = torch.empty_like(q)
    gqa = q.shape[2] != k.shape[2]
    for length, starts in _groups(tokens_per_image).items():
        if length == 0:
            continue
        index = (torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1).to(q.device)
        q_g, k_g, v_g = (
            t[0].index_select(0, index).view(len(starts), length, *t.shape[2:]).transpose(1, 2)
            for t in (q, k, v)
        )  # [n, heads, L, d]
        o = F.scaled_dot_product_attention(q_g, k_g, v_g, scale=softmax_scale, enable_gqa=gqa)
        out = out.index_copy(1, index, o.transpose(1, 2).reshape(1, -1, *q.shape[2:]))
    return out
