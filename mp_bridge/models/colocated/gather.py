"""The gather flow: bridge each LLM DP batch's images, place them, then partition.

Per rank (``S`` the LLM DP batch's sequence length, ``c`` CP size):

1. ragged images: :func:`~.step_agreement.agree_image_counts` (every rank, one small exchange);
2. encoder + projection on this rank's encoder DP shard: ``images [b_e, p, patch_dim]``
   -> ``[b_e, p, h]`` (TP-replicated), or ragged ``[T_e, patch_dim]`` -> ``[T_e, h]``;
3. ``bridge.communicate`` -> this rank's LLM DP shard ``[b_l, p, h]``; ragged:
   ``bridge.communicate_ragged`` -> ``[T_l, h]`` and the LLM shard's per-sample counts;
4. text embeddings of ``input_ids [b_l, S]`` with image rows placed at the placeholders
   (:func:`~mp_bridge.models.data.placement.place_images`; packed: one ``[1, T, h]`` row);
5. ``partition.shard`` -> CP (and SP) shards; LLM -> per-token loss -> masked mean
   (:func:`~.parts.shard_loss`).

Balanced (``ColocatedMimoModel(balance=True)``, ragged images): step 2 balances the raw
patches first and runs the encoder on the images this replica received, then returns the
features to their source replica (``ImageBalancer.restore``, one ``all_to_all_single``)
before step 3: the features cross replicas twice (there and back, then the bridge); the
routed flow sends them straight to their shards instead.

Every rank of a replica holds the full-sequence ``[b_l, S, h]`` embeddings and, in
backward, their gradient (the bridge's backward all-reduces it over CP).
"""

from __future__ import annotations

import torch

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.models.colocated.parts import MimoFlow, StepParts, shard_loss
from mp_bridge.models.colocated.step_agreement import agree_image_counts
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.data.placement import place_images

__all__ = ["GatherFlow"]


class GatherFlow(MimoFlow):
    """``flow="gather"``: full-sequence embeddings on every rank, then partition."""

    name = "gather"

    def loss(self, parts: StepParts, inputs: StepInputs) -> torch.Tensor:
        image, counts = None, None
        if inputs.has_images:
            if inputs.ragged and isinstance(parts.bridge, ColocatedBridgeCommunicator):
                agree_image_counts(parts.bridge, inputs)
            features, plan = parts.encode_balanced(inputs.images)
            if plan is not None:  # encoded where balanced: back to the source replica
                features = parts.balancer.restore(features, plan)
            image, counts = self.bridge_images(parts, features, inputs.images)
        embeddings = place_images(parts.llm.embed_tokens, inputs, image, counts)
        shard = parts.partition.shard(
            embeddings, labels=inputs.labels, loss_mask=inputs.loss_mask,
            cu_seqlens=inputs.documents,  # parsed at the door: padded here, not parsed again
        )  # fmt: skip
        return shard_loss(parts, shard.embeddings, shard)

    def bridge_images(
        self, parts: StepParts, image: torch.Tensor, images: torch.Tensor | RaggedImages
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder DP batch -> LLM DP batch: ``[b_e, p, h] -> [b_l, p, h]``, or ragged
        ``[T_e, h] -> [T_l, h]`` with the LLM batch's ``[b_l]`` token counts."""
        if isinstance(images, RaggedImages):
            return parts.bridge.communicate_ragged(image, images.tokens_per_sample)
        return parts.bridge.communicate(image), None
