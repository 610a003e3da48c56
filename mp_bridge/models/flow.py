"""The one MIMO step, a method per stage, shared by the reference and the colocated model.

``forward`` = check -> encode -> bridge -> place -> (partition ->) LLM -> loss. The
single-process :class:`ReferenceMimo` and the distributed :class:`ColocatedMimoModel`
take the same inputs (the reference the global batch, the colocated model this rank's
shards) and implement each stage their own way; only the order and the placement math
(:mod:`.placement`, pure torch) are common. Images are uniform ``[b, p, patch_dim]`` or
:class:`RaggedImages` (flat ``[T, patch_dim]`` tokens, per-sample counts).
"""

from __future__ import annotations

import torch
from torch import nn

from .images import RaggedImages
from .placement import check_ragged_image_tokens, place_image_embeddings, place_image_tokens

__all__ = ["MimoFlow"]

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
    ) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar).

        ``input_ids``/``labels``/``loss_mask`` ``[b, S]`` (the colocated model: this
        rank's LLM DP shard). ``images``: ``[b, p, patch_dim]``, :class:`RaggedImages`
        (the colocated model: this rank's encoder DP shard), or ``None`` (text only).
        """
        has_images = self.check_step(input_ids, labels, loss_mask, images)
        image, counts = None, None
        if has_images:
            image, counts = self.bridge_images(self.encode(images), images)
        embeddings = self.place(input_ids, image, counts)
        return self.mean_token_loss(embeddings, labels, loss_mask)

    # ---------------------------------------------------------------- stages
    def check_step(self, input_ids, labels, loss_mask, images: Images | None) -> bool:
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
        self, input_ids: torch.Tensor, image: torch.Tensor | None, counts: torch.Tensor | None
    ) -> torch.Tensor:
        """Text embeddings with the image rows at the placeholders (``counts``: ragged)."""
        text = self.embed_text(input_ids)
        if image is None or counts is None:
            return place_image_embeddings(text, image, input_ids, self.image_token_id)
        check_ragged_image_tokens(input_ids, self.image_token_id, counts)
        return place_image_tokens(text, image, input_ids, self.image_token_id)

    def mean_token_loss(
        self, embeddings: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """(Partition ->) LLM -> cross-entropy -> mean over the masked tokens of the batch."""
        raise NotImplementedError
