"""The model step's per-rank checks, fed into one agreement exchange over the whole grid.

A bad batch on one rank (a label out of range on one DP replica, too many image tokens
on one rank, a wrong shape) must not leave the healthy ranks waiting in a collective the
bad rank never reaches. So every per-rank check of a step runs first, locally, and its
outcome (plus whether this rank has images) goes through one exchange
(:func:`mp_bridge.comm.run_checked`, always on): a rank's error becomes the same
``AgreementError`` on every rank, naming that rank and its message.

Packed text (``cu_seqlens`` given, :mod:`.packed`) adds what one grid-wide exchange
cannot state: the ranks of one LLM DP replica (its TP x CP ranks) must hold the *same*
``cu_seqlens`` while other replicas hold their own documents. After the grid-wide
exchange (which also agrees on whether the text is packed), one exchange over the
replica's groups compares the ``cu_seqlens``, and a second grid-wide exchange spreads
its outcome, so a mismatch is the same ``AgreementError`` on every rank of the grid.
Plain text makes the one exchange only, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_bridge.comm import check_agreement, check_sample_counts, run_checked
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.packed import (
    check_cu_seqlens,
    check_packed_image_tokens,
    placeholder_counts,
)
from mp_bridge.models.data.placement import check_image_tokens

__all__ = ["agree_image_counts", "check_batch", "check_step"]

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
    cu_seqlens: object = None,
) -> None:
    """This rank's batch is well formed (local checks only; ``ValueError``/``TypeError``).

    Plain: ``[b, S]`` per-token tensors. Packed (``cu_seqlens`` given): 1-D ``[T]`` ones
    and ``cu_seqlens`` starting at 0, non-decreasing, ending at ``T``; uniform images allow
    at most ``num_patches`` placeholders per document.
    """
    for name, t in (("input_ids", input_ids), ("labels", labels), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    packed = cu_seqlens is not None
    if packed and input_ids.dim() != 1:
        raise ValueError(
            f"packed input_ids (cu_seqlens given) must be [T] or [1, T]; got "
            f"{tuple(input_ids.shape)}; concatenate this rank's documents, or pass "
            "cu_seqlens=None for [batch, seq] rows"
        )
    if not packed and input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [batch, seq]; got {tuple(input_ids.shape)}; pass this "
            "rank's LLM DP shard of full sequences (packed [T] documents need cu_seqlens)"
        )
    cu = check_cu_seqlens(cu_seqlens, input_ids.shape[0]) if packed else None
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
        if packed:
            check_packed_image_tokens(input_ids, image_token_id, cu, num_patches=num_patches)
        else:
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
    *,
    cu_seqlens: object = None,
    replica_groups: Sequence[dist.ProcessGroup | None] = (),
    **batch_spec: int,
) -> bool:
    """Check this rank's batch and agree over ``groups`` (their product: the whole grid).

    Returns whether images are present (then on every rank). Raises the same
    ``AgreementError`` (a ``ValueError``) on every rank when any rank's batch is bad or
    the ranks disagree on images being present or on the text being packed; without a
    group of size > 1 the local error itself. Packed (``cu_seqlens``): the ranks of
    ``replica_groups`` (their product: this rank's LLM DP replica) must also hold the
    same ``cu_seqlens``. Collectives: one small all-gather per group of size > 1;
    packed, then one per replica group and one more per grid group.
    """
    where = "ColocatedMimoModel.forward"

    def checks() -> dict[str, object]:
        check_batch(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens, **batch_spec)
        return {
            "whether images are present": images is not None,
            "whether the text is packed (cu_seqlens given)": cu_seqlens is not None,
        }

    run_checked(where, list(groups), checks, device=device, always=True)
    if cu_seqlens is not None:  # agreed above: every rank of the grid is here
        cu = check_cu_seqlens(cu_seqlens, input_ids.shape[0]).tolist()
        try:
            check_agreement(
                f"{where} (packed documents of one LLM DP replica)", list(replica_groups),
                {"cu_seqlens": cu}, device=device, always=True,
            )  # fmt: skip
            replica_error = None
        except ValueError as exc:  # only this replica's ranks saw it: tell the grid
            replica_error = exc

        def replica_outcome() -> dict[str, object]:
            if replica_error is not None:
                raise replica_error
            return {}

        run_checked(where, list(groups), replica_outcome, device=device, always=True)
    return images is not None


def agree_image_counts(
    bridge, input_ids: torch.Tensor, images: RaggedImages, image_token_id: int, cu_seqlens=None
) -> None:
    """Every sample's placeholders equal its image tokens, agreed over the bridge's ranks.

    The gather flow's counterpart of ``route``'s count check: this rank's encoder batch
    names each sample's tokens (``images.tokens_per_sample``), its LLM batch
    (``input_ids`` ``[b, S]``, or packed ``[T]`` with ``cu_seqlens``) each sample's
    placeholders. A mismatch in one LLM DP replica would otherwise raise in that replica
    only (at placement) and strand the others in the loss's all-reduce; here every rank
    raises the same ``ValueError`` naming the sample. Collectives: one 56-byte-per-rank
    all-gather over ``bridge.world_group`` (:func:`~mp_bridge.comm.check_sample_counts`).
    """
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, input_ids.shape[-1])
    check_sample_counts(
        bridge.plan,
        dist.get_rank(),
        bridge.world_group,
        encoder_counts=images.tokens_per_sample.tolist(),
        llm_counts=placeholder_counts(input_ids, image_token_id, cu).tolist(),
        device=input_ids.device,
        where="ColocatedMimoModel.forward",
    )
