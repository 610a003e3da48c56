"""``hf_batch``: a transformers LLaVA batch as our global :class:`MimoBatch`.

- Images: ``pixel_values [n, C, H, W]`` -> patches ``[n, P, C·p·p]`` by
  :func:`pixel_patches` (the conv patch embedding as a linear over flattened patches).
- Placeholders per image come from the vision config (``cfg.placeholders_per_image``), never
  from ``image_seq_length``; sample ``i`` holds ``k_i`` images when it holds
  ``k_i · image_placeholders`` image tokens, the images taken in order (HF's
  ``masked_scatter`` order). One image per sample gives uniform images
  ``[B, P, patch_dim]``; any other count gives :class:`RaggedImages`.
- Labels follow HF's convention: ``-100`` is ignored, and the shift happens inside HF's
  loss (position ``t`` predicts ``labels[t + 1]``). Ours are pre-shifted: our
  ``labels[:, t] = hf_labels[:, t + 1]`` (the last ``-100``) and ``loss_mask`` is 1 where
  it is not ``-100``, so our masked mean is HF's mean over its valid tokens.
  ``labels=None`` means ``input_ids`` with image and padding tokens set to ``-100``.
- Padding only on the right (``attention_mask`` rows of ones then zeros), with labels
  ``-100`` there; anything else is a ``ValueError``. Right padding changes nothing before
  it under causal attention, so our model needs no mask.
"""

from __future__ import annotations

import torch

from mp_bridge.checks import check_tensor
from mp_bridge.models.data.batch import MimoBatch
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import IGNORE_INDEX

__all__ = ["hf_batch", "pixel_patches"]


def pixel_patches(cfg: MimoConfig, pixel_values: torch.Tensor) -> torch.Tensor:
    """``[n, C, H, W]`` -> ``[n, (H/p)·(W/p), C·p·p]``: patches in row-major order, each
    flattened as ``(c, y, x)`` (the conv weight ``[h, C, p, p]`` flattened the same way).
    E.g. ``p = 2``, one ``[1, 4, 4]`` image: patch 1 is rows 0-1, columns 2-3."""
    check_tensor("pixel_values", pixel_values, dtype="float")
    p, c = cfg.patch_size, cfg.image_channels
    if pixel_values.dim() != 4 or pixel_values.shape[1] != c:
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values.shape)}; expected [images, {c}, H, W]"
        )
    n, _, height, width = pixel_values.shape
    if height % p or width % p or (height // p) * (width // p) != cfg.num_patches:
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values.shape)}: with patch size {p} an image "
            f"must give num_patches={cfg.num_patches} patches; resize to the vision config's "
            "image_size"
        )
    x = pixel_values.reshape(n, c, height // p, p, width // p, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(n, cfg.num_patches, c * p * p)


def _check_right_padding(attention_mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    check_tensor("attention_mask", attention_mask)
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected "
            f"{tuple(shape)} like input_ids"
        )
    keep = attention_mask != 0
    if bool((attention_mask.ne(0) & attention_mask.ne(1)).any()) or bool(
        (keep[:, 1:] & ~keep[:, :-1]).any()
    ):
        raise ValueError(
            "attention_mask must be right padding only (each row ones, then zeros); got "
            f"{attention_mask.tolist()[:2]}...; pad on the right (tokenizer padding_side="
            "'right')"
        )
    return ~keep


def hf_batch(
    cfg: MimoConfig,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> MimoBatch:
    """HF's ``(input_ids [B, S], pixel_values [n, C, H, W], labels, attention_mask)`` as
    our global batch (see the module)."""
    check_tensor("input_ids", input_ids, dtype="int")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; expected [batch, seq]")
    pad = torch.zeros_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        pad = _check_right_padding(attention_mask, input_ids.shape)
    is_image = input_ids == cfg.image_token_id
    if labels is None:
        labels = input_ids.masked_fill(is_image | pad, IGNORE_INDEX)
    check_tensor("labels", labels, dtype="int")
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels has shape {tuple(labels.shape)}; expected {tuple(input_ids.shape)}"
        )
    if bool((labels[pad] != IGNORE_INDEX).any()):
        raise ValueError(
            "labels must be -100 at padding (attention_mask 0); HF would train on those tokens"
        )
    ours = torch.full_like(labels, IGNORE_INDEX)
    ours[:, :-1] = labels[:, 1:]
    loss_mask = (ours != IGNORE_INDEX).to(torch.float32)
    per_sample = is_image.sum(dim=1)
    k = cfg.placeholders_per_image
    patches = pixel_patches(cfg, pixel_values)
    if bool((per_sample % k).any()) or int(per_sample.sum()) != k * patches.shape[0]:
        raise ValueError(
            f"input_ids hold {per_sample.tolist()} image tokens per sample, but each of the "
            f"{patches.shape[0]} images takes image_placeholders={k} (from the vision config); "
            "give each image exactly that many placeholders"
        )
    images_per_sample = per_sample // k
    if bool((images_per_sample == 1).all()):
        images = patches
    else:
        tokens = patches.reshape(-1, cfg.patch_dim)
        sizes = torch.full((patches.shape[0],), cfg.num_patches, dtype=torch.int64)
        images = RaggedImages(tokens, sizes, images_per_sample.cpu())
    return MimoBatch(images, input_ids, ours, loss_mask)
