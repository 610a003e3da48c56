"""The routed flow: shard the integer tensors first, route image rows to the shards.

``ColocatedMimoModel(..., flow="routed")`` runs :class:`RoutedFlow` on the inputs the
model parsed and agreed (:mod:`.step_agreement`). Per rank (``S`` the LLM DP batch's sequence
length, ``c`` CP size, ``t`` TP size):

1. ``partition.shard(None, input_ids=, labels=, loss_mask=)``: CP-local integer tensors
   ``[b, S/c]`` (no collective; sequences not divisible by the cut are padded, padding
   has loss mask 0 and is never an image position);
2. ``llm.embed_tokens`` of the local ids only -> ``[b, S/c, h]`` (one TP all-reduce); with
   SP, ``scatter_along`` keeps this TP rank's piece ``[b, S/(c·t), h]``;
3. encoder + projection on the encoder DP shard, then ``bridge.route``: each image token
   goes from the encoder rank holding it straight to the shard(s) consuming it ->
   ``[n_local, h]``, the image rows of the local shard in shard order (route's own
   metadata and token exchanges; backward one token exchange, no CP all-reduce);
4. those rows replace the local image positions (``index_copy``), LLM -> per-token loss
   ``[b, S/c]`` -> ``masked_mean`` over the LLM DP x CP group.

Balanced (``ColocatedMimoModel(balance=True)``, ragged images): step 3 balances the raw
patches over the encoder DP replicas first, encodes what this replica received and
routes each encoded row straight from its encoder to its shard(s)
(``route(..., balance=plan)``): every patch row and every feature row moves at most once.

No tensor of the full sequence length with a hidden dim exists on any rank (only the
``[b, S]`` integer/bool inputs). Uniform images ``[b_e, p, h]``: sample ``i`` uses its
first ``n_i`` patch rows (``n_i`` its placeholders); the encoder side learns the ``n_i`` of
its samples with one all-gather of ``[b_l]`` int64 counts over the encoder TP group (which
holds the whole encoder DP replica, hence every LLM sample of its batch); ragged images
need no extra collective. Numerics: the same products as the gather flow (the text rows
are the same lookups, the image rows the same rows), so losses and gradients agree with
it up to summation order.

Packed text (``cu_seqlens``; document ``i`` = sample ``i``): step 1 shards the 1-D
``[T]`` tensors with the documents parsed at the door (each padded to its CP cut), step 2
embeds the local ids as one ``[1, T_pad/c, h]`` row, step 3 passes ``bridge.route`` the
packed ``image_mask [T]`` and ``ShardedBatch.layout``, and step 4 gives the LLM that
layout so attention stays inside each document; ``cu_seqlens`` is parsed once per step. Uniform
images: ``n_i`` is document ``i``'s placeholder count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mp_bridge.comm import ShardedBatch, all_gather_tensor, group_size, scatter_along
from mp_bridge.models.colocated.parts import MimoFlow, StageFeed, StepParts, shard_loss
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.data.packed import rows_per_document

__all__ = ["RoutedFlow", "encoder_image_rows", "local_embeddings", "place_local_rows"]


def place_local_rows(text: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``text [b, s, h]`` with its ``mask [b, s]`` positions replaced by ``rows [n, h]`` in
    row-major order (the order of ``text[mask]``). Differentiable in both (``index_copy``)."""
    where = mask.reshape(-1).nonzero().squeeze(1)
    if where.numel() != rows.shape[0] or rows.shape[-1] != text.shape[-1]:
        raise ValueError(
            f"{where.numel()} local image positions of hidden {text.shape[-1]} but the routed "
            f"rows have shape {tuple(rows.shape)}; route must return the local shard's rows"
        )
    flat = text.reshape(-1, text.shape[-1]).index_copy(0, where, rows.to(text.dtype))
    return flat.view_as(text)


def local_embeddings(
    parts: StepParts, shard: ShardedBatch, image_token_id: int, *, packed: bool, embed: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Steps 1-2 on one partitioned batch: ``(embeddings, is_image)``, the local ids'
    embeddings ``[b, S/c, h]`` (packed: one row; SP: this TP rank's piece ``[b, S/(c·t),
    h]``) and the bool mask of their image positions. ``embed=False``: the mask alone
    (``embeddings`` ``None``, no collective)."""
    part = parts.partition
    local_ids = shard.input_ids  # [b, S/c], packed [T_pad/c]
    is_image = local_ids == image_token_id
    if shard.token_mask is not None:  # padding (id 0) is never an image position
        is_image = is_image & shard.token_mask.to(is_image.device)
    if packed:  # one packed row
        local_ids, is_image = local_ids.unsqueeze(0), is_image.unsqueeze(0)
    embeddings = parts.llm.embed_tokens(local_ids) if embed else None  # TP-replicated
    if part.sequence_parallel and part.tp_size > 1:
        if embed:
            embeddings = scatter_along(embeddings, part.tp_group, 1)  # [b, S/(c·t), h]
        piece = is_image.shape[1] // part.tp_size
        is_image = is_image.narrow(1, part.tp_rank * piece, piece)
    return embeddings, is_image


class RoutedFlow(MimoFlow):
    """``flow="routed"``: no full-sequence activation or gradient on any rank."""

    name = "routed"

    def loss(self, parts: StepParts, inputs: StepInputs) -> torch.Tensor:
        shard = parts.partition.shard(
            None, input_ids=inputs.input_ids, labels=inputs.labels,
            loss_mask=inputs.loss_mask, cu_seqlens=inputs.documents,
        )  # fmt: skip
        embeddings, is_image = local_embeddings(
            parts, shard, inputs.image_token_id, packed=inputs.packed
        )
        if inputs.has_images:
            # the layout shard built: route parses nothing
            rows = self.route_rows(parts, inputs, layout=shard.layout)
            embeddings = place_local_rows(embeddings, rows, is_image)
        return shard_loss(parts, embeddings, shard)  # LLM -> per-token loss -> masked_mean

    def route_rows(self, parts: StepParts, inputs: StepInputs, **where) -> torch.Tensor:
        """Step 3: encode (balanced or not), then ``bridge.route`` -> ``[n_local, h]``, the
        image rows of this rank's shard in shard order. ``where``: ``layout=`` (the
        partitioned batch's) or ``cu_seqlens=``."""
        features, plan = parts.encode_balanced(inputs.images)
        if plan is None:
            x, counts = encoder_image_rows(parts, features, inputs)
        else:  # balanced rows: the plan names their holders, counts stay pre-balance
            x, counts = features, inputs.images.tokens_per_sample
        return parts.bridge.route(
            x, tokens_per_sample=counts, image_mask=inputs.image_mask,
            partition=parts.partition, balance=plan, **where,
        )  # fmt: skip

    # ------------------------------------------------------ pipelined LLM (pp > 1)
    def check_pipelined(self, parts: StepParts, inputs: StepInputs) -> None:
        super().check_pipelined(parts, inputs)
        part = parts.partition
        if inputs.packed and part.sequence_parallel and part.tp_size > 1:
            raise ValueError(
                "flow='routed' with a pipelined LLM cannot microbatch packed text under "
                "sequence parallelism (the SP split crosses documents); use flow='gather' "
                "or sequence_parallel=False"
            )

    def deliver(self, parts: StepParts, inputs: StepInputs) -> tuple[torch.Tensor, None]:
        """The whole LLM DP batch's rows routed to the first stage's CP/SP shard
        (``[n_local, h]``, shard order of the whole batch; ``[0, h]`` off stage 0)."""
        return self.route_rows(parts, inputs, cu_seqlens=inputs.cu_seqlens), None

    def stage_inputs(self, parts: StepParts, feed: StageFeed) -> Callable[[int], torch.Tensor]:
        """Microbatch ``m``: its local embeddings with its block of ``feed.rows`` placed
        (the rows of microbatch ``m`` are contiguous in shard order: the CP cut is per row
        / per document, plain SP splits each row; ``RuntimeError`` when the blocks do not
        add up to ``feed.rows``)."""
        microbatches, rows = feed.microbatches, feed.rows
        starts = [0] * len(microbatches)
        if rows is not None:
            at = 0  # each microbatch's first routed row: its local image positions, in order
            for m, mb in enumerate(microbatches):
                starts[m] = at
                _, is_image = local_embeddings(
                    parts, mb.shard, mb.inputs.image_token_id, packed=mb.inputs.packed,
                    embed=False,
                )  # fmt: skip
                at += int(is_image.sum())
            if at != rows.shape[0]:
                raise RuntimeError(f"routed {rows.shape[0]} rows but the microbatches hold {at}")

        def embeddings(m: int) -> torch.Tensor:
            mb = microbatches[m]
            emb, is_image = local_embeddings(
                parts, mb.shard, mb.inputs.image_token_id, packed=mb.inputs.packed
            )
            if rows is None:
                return emb
            n = int(is_image.sum())
            return place_local_rows(emb, rows[starts[m] : starts[m] + n], is_image)

        return embeddings


def encoder_image_rows(parts: StepParts, image: torch.Tensor, inputs: StepInputs):
    """``(x [T, h], tokens_per_sample [b_e])`` of this rank's encoder DP batch.

    Ragged: the encoder output and its counts. Uniform ``[b_e, p, h]``: the first ``n_i``
    rows of each sample, ``n_i`` its placeholder count in the LLM batch holding it (one
    all-gather of the LLM batches' counts over the encoder TP group; see the module).
    One process (a bridge without a plan, :class:`~mp_bridge.comm.LocalBridge`): the LLM
    batch is the encoder batch.
    """
    if inputs.ragged:
        return image, inputs.image_counts
    counts = inputs.placeholders  # [b_l]
    plan = parts.bridge.plan
    if plan is None:
        return rows_per_document(image, counts), counts
    rank, group = dist.get_rank(), parts.groups.encoder_tp
    members = [rank] if group_size(group) == 1 else dist.get_process_group_ranks(group)
    gathered = all_gather_tensor(counts, group, 0).view(len(members), -1).cpu()
    per_replica = {plan.dest.coords(m)["dp"]: row for m, row in zip(members, gathered)}
    b_e, b_l = image.shape[0], counts.shape[0]
    first = plan.src.coords(rank)["dp"] * b_e  # global index of this encoder batch's sample 0
    n = torch.stack([per_replica[g // b_l][g % b_l] for g in range(first, first + b_e)])
    return rows_per_document(image, n), n
