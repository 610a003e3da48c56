"""The model step's per-rank checks, fed into one agreement exchange over the whole grid.

A bad batch on one rank (a label out of range on one DP replica, too many image tokens
on one rank, a wrong shape) must not leave the healthy ranks waiting in a collective the
bad rank never reaches. So every per-rank check of a step runs first, locally, and its
outcome (plus whether this rank has images) goes through one exchange
(:func:`mp_bridge.comm.run_checked`, always on): a rank's error becomes the same
``AgreementError`` on every rank, naming that rank and its message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_bridge.comm import run_checked

from .images import RaggedImages
from .placement import check_image_tokens

__all__ = ["check_batch", "check_step"]

IGNORE_INDEX = -100  # the LLM's cross-entropy default: labels may take it


def check_batch(
    input_ids: object,
    labels: object,
    loss_mask: object,
    images: object,
    *,
    vocab_size: int,
    image_token_id: int,
    num_patches: int,
    patch_dim: int,
) -> None:
    """This rank's batch is well formed (local checks only; ``ValueError``/``TypeError``)."""
    for name, t in (("input_ids", input_ids), ("labels", labels), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq]; got {tuple(input_ids.shape)}; pass this "
            "rank's LLM DP shard of full sequences"
        )
    for name, t in (("labels", labels), ("loss_mask", loss_mask)):
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; give one value per token"
            )
    for name, t, extra in (("input_ids", input_ids, None), ("labels", labels, IGNORE_INDEX)):
        bad = (t < 0) | (t >= vocab_size)
        if extra is not None:
            bad &= t != extra
        if bool(bad.any()):  # host sync: a bad id would fail later inside a collective
            allowed = f" or {extra} (ignored)" if extra is not None else ""
            raise ValueError(
                f"{name} holds {int(t[bad].flatten()[0])}, outside [0, {vocab_size}){allowed}; "
                "fix the batch or the vocab size"
            )
    if isinstance(images, RaggedImages):
        if images.tokens.shape[-1] != patch_dim:
            raise ValueError(
                f"images.tokens has shape {tuple(images.tokens.shape)}; expected [T, "
                f"patch_dim={patch_dim}]"
            )
    elif images is not None:
        if not isinstance(images, torch.Tensor):
            raise TypeError(
                f"images must be a torch.Tensor, RaggedImages or None, got {type(images).__name__}"
            )
        check_image_tokens(input_ids, image_token_id, num_patches)
        if images.dim() != 3 or images.shape[1] != num_patches:
            raise ValueError(
                f"images has shape {tuple(images.shape)}; expected [batch, "
                f"num_patches={num_patches}, patch_dim={patch_dim}] or RaggedImages"
            )


def check_step(
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
    input_ids: object,
    labels: object,
    loss_mask: object,
    images: object,
    **batch_spec: int,
) -> bool:
    """Check this rank's batch and agree over ``groups`` (their product: the whole grid).

    Returns whether images are present (then on every rank). Raises the same
    ``AgreementError`` (a ``ValueError``) on every rank when any rank's batch is bad or
    the ranks disagree on images being present; without a group of size > 1 the local
    error itself. Collectives: one small all-gather per group of size > 1.
    """

    def checks() -> dict[str, object]:
        check_batch(input_ids, labels, loss_mask, images, **batch_spec)
        return {"whether images are present": images is not None}

    run_checked("ColocatedMimoModel.forward", list(groups), checks, device=device, always=True)
    return images is not None
