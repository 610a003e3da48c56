"""Synthetic transformers LLaVA batches for a :class:`MimoConfig` read by ``config_from_hf``.

:func:`llava_inputs` lays out given image counts; :func:`synthetic_llava_inputs` draws
them (and the right padding) from a seed. Both return HF's forward arguments
(:class:`LlavaInputs`): ``input_ids [B, S]`` with runs of ``placeholders_per_image``
image tokens (``image_token_id``, from the HF config), ``pixel_values [n, C, H, W]`` at
the vision config's image size, a right-padded ``attention_mask`` and ``labels`` (-100 at
image tokens and padding). Sample ``i`` with ``k`` images and ``p`` placeholders each,
``S = 16``, ``p = 4``, ``k = 2``: text at 0, images at 1-4 and 6-9, text from 10 on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mp_bridge.checks import check_int
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.inputs import IGNORE_INDEX

__all__ = ["LlavaInputs", "llava_inputs", "max_images", "synthetic_llava_inputs"]


class LlavaInputs(NamedTuple):
    """``LlavaForConditionalGeneration``'s forward arguments (``model(**inputs._asdict())``)."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


def max_images(cfg: MimoConfig, seq_len: int) -> int:
    """Images that fit in one sample: one text token before each run of placeholders,
    one after (``(S - 1) // (p + 1)``; ``S = 16``, ``p = 4``: 3)."""
    return (seq_len - 1) // (cfg.placeholders_per_image + 1)


def llava_inputs(
    cfg: MimoConfig,
    images_per_sample: Sequence[int],
    *,
    seq_len: int | None = None,
    pad: Sequence[int] = (),
    seed: int = 0,
) -> LlavaInputs:
    """HF inputs holding ``images_per_sample[i]`` images in sample ``i`` (see the module),
    ``pad[i]`` padding tokens at its end (missing entries: 0), text ids drawn uniformly
    from the vocabulary without the image token, pixels from a standard normal."""
    seq = cfg.seq_len if seq_len is None else check_int("seq_len", seq_len, low=1)
    k, b = cfg.placeholders_per_image, len(images_per_sample)
    if b == 0 or len(pad) > b:
        raise ValueError(
            f"images_per_sample={tuple(images_per_sample)} / pad={tuple(pad)}: give one image "
            "count per sample (at least one sample) and at most one pad per sample"
        )
    pads = [*pad, *([0] * (b - len(pad)))]
    for i, (n, p) in enumerate(zip(images_per_sample, pads)):
        if n < 0 or p < 0 or 1 + n * (k + 1) > seq - p + 1:
            raise ValueError(
                f"sample {i}: {n} images of {k} placeholders and pad {p} do not fit in "
                f"seq_len={seq}; use at most {max_images(cfg, seq - p)} images there"
            )
    side = math.isqrt(cfg.num_patches) * cfg.patch_size
    if (side // cfg.patch_size) ** 2 != cfg.num_patches:
        raise ValueError(f"num_patches={cfg.num_patches} is not a square grid of patches")
    g = torch.Generator().manual_seed(seed)
    image = cfg.image_token_id
    ids = torch.randint(0, cfg.vocab_size - 1, (b, seq), generator=g)  # one id fewer:
    ids += (ids >= image).long()  # skip the image token
    for i, n in enumerate(images_per_sample):
        for j in range(n):
            start = 1 + j * (k + 1)
            ids[i, start : start + k] = image
    mask = torch.ones(b, seq, dtype=torch.long)
    for i, p in enumerate(pads):
        if p:
            mask[i, seq - p :] = 0
    shape = (sum(images_per_sample), cfg.image_channels, side, side)
    pixels = torch.randn(*shape, generator=g)
    labels = ids.masked_fill((ids == image) | (mask == 0), IGNORE_INDEX)
    return LlavaInputs(ids, pixels, mask, labels)


def synthetic_llava_inputs(
    cfg: MimoConfig, batch_size: int, *, seed: int = 0, images: tuple[int, int] = (0, 3)
) -> LlavaInputs:
    """A seeded ragged batch: each sample ``images[0]..images[1]`` images (capped by
    :func:`max_images`, at least one image in the batch) and a random right padding that
    leaves every image and one text token after it."""
    check_int("batch_size", batch_size, low=1)
    lo, hi = images
    hi = min(hi, max_images(cfg, cfg.seq_len))
    if not 0 <= lo <= hi or hi == 0:
        raise ValueError(
            f"images={images}: need 0 <= low <= high and high >= 1; at seq_len={cfg.seq_len} "
            f"a sample holds at most {max_images(cfg, cfg.seq_len)} images"
        )
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(lo, hi + 1, (batch_size,), generator=g)
    if int(counts.sum()) == 0:
        counts[0] = 1
    k, pads = cfg.placeholders_per_image, []
    for n in counts.tolist():
        free = cfg.seq_len - (1 + n * (k + 1))
        pads.append(int(torch.randint(0, free + 1, (1,), generator=g)))
    return llava_inputs(cfg, counts.tolist(), pad=pads, seed=seed + 1)
