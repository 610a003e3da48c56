"""The one MIMO step, a method per stage, shared by the reference and the colocated model.

``forward`` = check -> encode -> bridge -> place -> (partition ->) LLM -> loss. The
single-process :class:`ReferenceMimo` and the distributed :class:`ColocatedMimoModel`
take the same inputs (the reference the global batch, the colocated model this rank's
shards) and implement each stage their own way; only the order and the placement math
(:mod:`.placement`, pure torch) are common. Images are uniform ``[b, p, patch_dim]`` or
:class:`RaggedImages` (flat ``[T, patch_dim]`` tokens, per-sample counts).

Text is plain ``[b, S]`` rows, or packed (THD, :mod:`.packed`): 1-D ``[T]`` tokens with
``cu_seqlens=[0, l0, l0+l1, ...]``, document ``i`` being sample ``i`` (of the images and of
the loss). Packed text is embedded as one ``[1, T, h]`` row; sample ``i``'s image rows
fill document ``i``'s placeholders (uniform images: its first ``n_i`` patch rows); each
document is an independent causal sequence and the loss is the masked mean over every
token of every document, as for plain rows.
"""

from __future__ import annotations

import torch
from torch import nn

from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.packed import (
    check_cu_seqlens,
    check_packed_image_tokens,
    placeholder_counts,
    rows_per_document,
)
from mp_bridge.models.data.placement import (
    check_ragged_image_tokens,
    place_image_embeddings,
    place_image_tokens,
)

__all__ = ["MimoFlow", "packed_tokens"]

Images = torch.Tensor | RaggedImages


class MimoFlow(nn.Module):
    """Base of both MIMO models; subclasses define the stages and ``image_token_id``."""

    image_token_id: int

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        images: Images | None = None,
        *,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar).

        ``input_ids``/``labels``/``loss_mask`` ``[b, S]`` (the colocated model: this
        rank's LLM DP shard), or packed ``[T]`` (``[1, T]`` accepted) with ``cu_seqlens``
        ``[b + 1]`` (the colocated model: the documents of this rank's LLM DP shard, in
        sample order). ``images``: ``[b, p, patch_dim]``, :class:`RaggedImages` (the
        colocated model: this rank's encoder DP shard), or ``None`` (text only).
        """
        input_ids, labels, loss_mask, cu_seqlens, has_images = self.checked_inputs(
            input_ids, labels, loss_mask, images, cu_seqlens
        )
        image, counts = None, None
        if has_images:
            image, counts = self.bridge_images(self.encode(images), images)
        embeddings = self.place(input_ids, image, counts, cu_seqlens=cu_seqlens)
        return self.mean_token_loss(embeddings, labels, loss_mask, cu_seqlens=cu_seqlens)

    def checked_inputs(self, input_ids, labels, loss_mask, images, cu_seqlens):
        """Every flow's prologue: packed tensors made 1-D, :meth:`check_step`, and
        ``cu_seqlens`` as a CPU int64 tensor. Returns ``(input_ids, labels, loss_mask,
        cu_seqlens, has_images)``."""
        if cu_seqlens is not None:
            input_ids, labels, loss_mask = map(packed_tokens, (input_ids, labels, loss_mask))
        has_images = self.check_step(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)
        if cu_seqlens is not None:  # checked above: now a CPU int64 tensor
            cu_seqlens = check_cu_seqlens(cu_seqlens, input_ids.shape[-1])
        return input_ids, labels, loss_mask, cu_seqlens, has_images

    # ---------------------------------------------------------------- stages
    def check_step(
        self, input_ids, labels, loss_mask, images: Images | None, *, cu_seqlens=None
    ) -> bool:
        """Validate the inputs; return whether this step has images."""
        raise NotImplementedError

    def encode(self, images: Images) -> torch.Tensor:
        """Encoder + projection: ``[b, p, h]``, or ``[T, h]`` for ragged images."""
        return self.projection(self.encoder(images))

    def bridge_images(
        self, image: torch.Tensor, images: Images
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Image embeddings of the LLM's samples and, ragged, their ``[b]`` token counts."""
        raise NotImplementedError

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text embeddings ``[b, S, h]``."""
        raise NotImplementedError

    def place(
        self,
        input_ids: torch.Tensor,
        image: torch.Tensor | None,
        counts: torch.Tensor | None,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text embeddings with the image rows at the placeholders (``counts``: ragged):
        ``[b, S, h]``, or packed ``[1, T, h]`` (document ``i`` takes sample ``i``'s rows)."""
        if cu_seqlens is not None:
            return self._place_packed(input_ids, image, counts, cu_seqlens)
        text = self.embed_text(input_ids)
        if image is None or counts is None:
            return place_image_embeddings(text, image, input_ids, self.image_token_id)
        check_ragged_image_tokens(input_ids, self.image_token_id, counts)
        return place_image_tokens(text, image, input_ids, self.image_token_id)

    def _place_packed(self, input_ids, image, counts, cu_seqlens) -> torch.Tensor:
        ids = input_ids.unsqueeze(0)  # [1, T]: one packed row
        text = self.embed_text(ids)
        if image is None:
            return text
        if counts is None:  # uniform [b, p, h]: document i takes sample i's first n_i rows
            n = placeholder_counts(input_ids, self.image_token_id, cu_seqlens)
            if image.shape[0] != n.shape[0]:
                raise ValueError(
                    f"{image.shape[0]} samples of image embeddings for {n.shape[0]} packed "
                    "documents; document i is sample i of this LLM DP batch"
                )
            image = rows_per_document(image, n.to(image.device))
        else:
            check_packed_image_tokens(
                input_ids, self.image_token_id, cu_seqlens, tokens_per_sample=counts
            )
        return place_image_tokens(text, image, ids, self.image_token_id)

    def mean_token_loss(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(Partition ->) LLM -> cross-entropy -> mean over the masked tokens of the batch
        (packed: ``embeddings [1, T, h]``, per-token tensors ``[T]``, documents independent)."""
        raise NotImplementedError


def packed_tokens(t: object) -> object:
    """A packed per-token tensor given as ``[1, T]`` -> ``[T]``; anything else unchanged
    (the step check then judges it)."""
    if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 1:
        return t.reshape(-1)
    return t
