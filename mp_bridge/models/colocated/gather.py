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

from collections.abc import Callable

import torch

from mp_bridge.models.colocated.parts import MimoFlow, StageFeed, StepParts, shard_loss
from mp_bridge.models.colocated.step_agreement import agree_image_counts
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import BatchSpec, StepInputs, image_output_counts
from mp_bridge.models.data.placement import place_images

__all__ = ["GatherFlow"]


class GatherFlow(MimoFlow):
    """``flow="gather"``: full-sequence embeddings on every rank, then partition."""

    name = "gather"

    def loss(self, parts: StepParts, inputs: StepInputs) -> torch.Tensor:
        image, counts = self.deliver(parts, inputs) if inputs.has_images else (None, None)
        embeddings = place_images(parts.llm.embed_tokens, inputs, image, counts)
        shard = parts.partition.shard(
            embeddings, labels=inputs.labels, loss_mask=inputs.loss_mask,
            cu_seqlens=inputs.documents,  # parsed at the door: padded here, not parsed again
        )  # fmt: skip
        return shard_loss(parts, shard.embeddings, shard)

    def deliver(
        self, parts: StepParts, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1-3 (module docstring): ``(image, counts)``, this rank's LLM DP batch of
        image rows ``[b_l, p, h]`` (ragged ``[T_l, h]`` and its ``[b_l]`` counts, else
        ``None``). With a pipelined LLM: on stage 0, ``[0, ...]`` on a later stage."""
        if inputs.ragged:
            agree_image_counts(parts.bridge, inputs)
        features, plan = parts.encode_balanced(inputs.images)
        if plan is not None:  # encoded where balanced: back to the source replica
            features = parts.balancer.restore(features, plan)
        return self.bridge_images(parts, features, inputs.images)

    def bridge_images(
        self, parts: StepParts, image: torch.Tensor, images: torch.Tensor | RaggedImages
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder DP batch -> LLM DP batch: ``[b_e, p, h] -> [b_l, p, h]``, or ragged
        ``[T_e, h] -> [T_l, h]`` with the LLM batch's ``[b_l]`` token counts (the encoder
        rows per sample are its output tokens, :func:`image_output_counts`)."""
        if isinstance(images, RaggedImages):
            counts = image_output_counts(images, BatchSpec.of(parts.encoder.cfg))
            return parts.bridge.communicate_ragged(image, counts)
        return parts.bridge.communicate(image), None

    def stage_inputs(self, parts: StepParts, feed: StageFeed) -> Callable[[int], torch.Tensor]:
        """Microbatch ``m``: its samples' rows of ``feed.rows`` (ragged: their token rows,
        by ``feed.counts``) placed in its full-sequence embeddings (plus the capacity
        padding document, packed), then partitioned."""
        rows, counts = feed.rows, feed.counts

        def embeddings(m: int) -> torch.Tensor:
            mb = feed.microbatches[m]
            a, b = mb.samples.start, mb.samples.stop
            image, mb_counts = None, None
            if rows is not None and counts is not None:  # ragged: token rows of its samples
                start = int(counts[:a].sum())
                mb_counts = counts[a:b]
                image = rows[start : start + int(mb_counts.sum())]
            elif rows is not None:
                image = rows[a:b]
            emb = place_images(parts.llm.embed_tokens, mb.inputs, image, mb_counts)
            if mb.pad:  # the capacity padding document: never attended by real tokens, no loss
                emb = torch.cat([emb, emb.new_zeros(1, mb.pad, emb.shape[-1])], dim=1)
            return parts.partition.shard(emb, cu_seqlens=mb.shard.cu_seqlens).embeddings

        return embeddings
