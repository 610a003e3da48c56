"""The colocated step with a pipelined LLM (LLM PP > 1) over ``M`` microbatches.

Three phases on every rank of the shared grid (:func:`pipelined_step`):

1. **encoder forward once** over this rank's encoder DP batch, then **delivery to
   stage 0**: the gather flow bridges the whole LLM DP batch's image rows
   (``communicate`` / ``communicate_ragged``: ``[b_l, p, h]`` / ``[T_l, h]`` on stage 0,
   ``[0, ...]`` on a later stage); the routed flow routes them straight to the first
   stage's CP/SP shard (``route``: ``[n_local, h]``, shard order of the whole batch).
2. ``rows = delivered.detach().requires_grad_()``; the LLM runs under
   :class:`~mp_bridge.models.parallel.pipeline.LLMPipeline` (1F1B, or GPipe when
   ``M < PP``) over the microbatches (:func:`split_microbatches`): stage 0 embeds each
   microbatch's ids and places its slice of ``rows`` (leaves: their gradient accumulates
   through the schedule's backward), every stage gets the position ids, the last stage
   the labels and loss mask.
3. ``torch.autograd.backward(delivered, rows.grad)`` on every rank (an empty gradient off
   stage 0: the bridge's backward exchange still needs every rank), which runs the
   bridge's backward and the encoder's.

The loss is each microbatch's masked sum divided by the step's global token count,
summed: the single-process masked mean, returned detached and equal on every rank.

Microbatch ``m`` of an LLM DP batch of ``b`` samples is samples ``[m·b/M, (m+1)·b/M)``.
Packed text: each microbatch is padded to one capacity agreed over the bridge's world
(:mod:`~mp_bridge.models.parallel.pipeline_capacity`), so every stage's buffers have one
shape. Routed flow: the rows of microbatch ``m`` are a contiguous block of the routed
rows (the CP cut is per row / per document, and plain SP splits each row), except for
packed text with SP, where the SP split crosses documents: that combination is a
``ValueError`` (use the gather flow).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mp_bridge.comm import ColocatedBridgeCommunicator, scatter_along
from mp_bridge.models.colocated.parts import StepParts
from mp_bridge.models.colocated.routed import encoder_image_rows, place_local_rows
from mp_bridge.models.colocated.step_agreement import agree_image_counts
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.data.placement import place_images
from mp_bridge.models.parallel.pipeline import LLMPipeline
from mp_bridge.models.parallel.pipeline_capacity import agree_capacity, packed_length, pad_packed_to

__all__ = ["Microbatch", "pipelined_step", "split_microbatches"]


@dataclass(frozen=True)
class Microbatch:
    """One microbatch: ``inputs`` (its samples' :class:`StepInputs`, unpadded; placement
    uses them), ``samples`` (its range in the LLM DP batch) and the partitioned integer
    tensors (``shard``: a ``ShardedBatch`` of the padded microbatch); ``pad`` tokens of
    capacity padding were appended (packed)."""

    inputs: StepInputs
    samples: range
    shard: object
    pad: int


def _slice_inputs(inputs: StepInputs, samples: range) -> StepInputs:
    a, b = samples.start, samples.stop
    if inputs.packed:
        cu = inputs.cu_seqlens
        lo, hi = int(cu[a]), int(cu[b])
        tok = slice(lo, hi)
        cu = cu[a : b + 1] - cu[a]
    else:
        tok, cu = slice(a, b), None
    return dataclasses.replace(
        inputs, input_ids=inputs.input_ids[tok], labels=inputs.labels[tok],
        loss_mask=inputs.loss_mask[tok], images=None, cu_seqlens=cu,
        placeholders=inputs.placeholders[a:b],
    )  # fmt: skip


def split_microbatches(parts: StepParts, inputs: StepInputs, m: int) -> list[Microbatch]:
    """``m`` microbatches of this rank's LLM DP batch, partitioned (integer tensors only).

    Packed: one ``agree_capacity`` all-reduce over the bridge's world group (every rank
    calls it). ``ValueError`` when ``m`` does not divide the batch (the same on every rank
    of a replica; the agreement before made the sample counts equal)."""
    b = int(inputs.placeholders.shape[0])
    if b % m:
        raise ValueError(
            f"microbatches={m} does not divide this rank's LLM DP batch of {b} samples; "
            f"pass a global batch whose LLM DP shards are multiples of {m}"
        )
    per = b // m
    pieces = [_slice_inputs(inputs, range(i * per, (i + 1) * per)) for i in range(m)]
    part = parts.partition
    cap = None
    if inputs.packed:
        bridge = parts.bridge
        group = bridge.world_group if isinstance(bridge, ColocatedBridgeCommunicator) else None
        local = max(packed_length(p.cu_seqlens, part.cp_size) for p in pieces)
        cap = agree_capacity(
            local, cp=part.cp_size, tp=part.tp_size, sequence_parallel=part.sequence_parallel,
            group=group, device=inputs.input_ids.device,
        )  # fmt: skip
    out = []
    for i, mb in enumerate(pieces):
        ids, labels, mask, cu, pad = mb.input_ids, mb.labels, mb.loss_mask, mb.cu_seqlens, 0
        if cap is not None:
            cu, ids, labels, mask = pad_packed_to(
                cap, cp=part.cp_size, cu_seqlens=cu, input_ids=ids, labels=labels,
                loss_mask=mask,
            )  # fmt: skip
            pad = len(ids) - len(mb.input_ids)
        shard = part.shard(None, input_ids=ids, labels=labels, loss_mask=mask, cu_seqlens=cu)
        out.append(Microbatch(mb, range(i * per, (i + 1) * per), shard, pad))
    return out


def _deliver(parts: StepParts, inputs: StepInputs, flow: str):
    """Phase 1: ``(delivered, counts)``: this rank's delivered image rows (autograd-
    connected to the encoder) and, gather flow with ragged images, its LLM batch's
    tokens per sample."""
    image, plan = parts.encode_balanced(inputs.images)  # plan: balanced ragged images
    if flow == "routed":
        x, counts = encoder_image_rows(parts, image, inputs) if plan is None else (
            image, inputs.images.tokens_per_sample)  # fmt: skip
        balanced = {} if plan is None else {"balance": plan}
        rows = parts.bridge.route(
            x, tokens_per_sample=counts, image_mask=inputs.image_mask,
            partition=parts.partition, cu_seqlens=inputs.cu_seqlens, **balanced,
        )  # fmt: skip
        return rows, None
    if plan is not None:  # gather flow: features back to their source replica first
        image = parts.balancer.restore(image, plan)
    if inputs.ragged:
        return parts.bridge.communicate_ragged(image, inputs.images.tokens_per_sample)
    return parts.bridge.communicate(image), None


def _gather_inputs(parts: StepParts, mb: Microbatch, rows, counts):
    """Stage 0, gather flow: microbatch ``mb``'s partitioned embeddings."""
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


def _routed_inputs(parts: StepParts, mb: Microbatch, rows, start: int):
    """Stage 0, routed flow: embed the local ids, place the local image rows
    ``rows[start:]`` (as many as the shard has image positions)."""
    part, shard, packed = parts.partition, mb.shard, mb.inputs.packed
    local_ids = shard.input_ids
    is_image = local_ids == mb.inputs.image_token_id
    if shard.token_mask is not None:
        is_image = is_image & shard.token_mask.to(is_image.device)
    if packed:
        local_ids, is_image = local_ids.unsqueeze(0), is_image.unsqueeze(0)
    emb = parts.llm.embed_tokens(local_ids)
    if part.sequence_parallel and part.tp_size > 1:
        emb = scatter_along(emb, part.tp_group, 1)
        piece = is_image.shape[1] // part.tp_size
        is_image = is_image.narrow(1, part.tp_rank * piece, piece)
    if rows is None:
        return emb, 0
    n = int(is_image.sum())
    return place_local_rows(emb, rows[start : start + n], is_image), n


def pipelined_step(
    parts: StepParts, inputs: StepInputs, *, pipeline: LLMPipeline, microbatches: int, flow: str
) -> torch.Tensor:
    """One training step's forward and backward (module docstring); the detached loss."""
    part = parts.partition
    if flow == "routed" and inputs.packed and part.sequence_parallel and part.tp_size > 1:
        raise ValueError(
            "flow='routed' with a pipelined LLM cannot microbatch packed text under sequence "
            "parallelism (the SP split crosses documents); use flow='gather' or "
            "sequence_parallel=False"
        )
    mbs = split_microbatches(parts, inputs, microbatches)
    stage = pipeline.stage
    delivered = rows = counts = None
    if inputs.has_images:
        if (
            flow == "gather"
            and inputs.ragged
            and isinstance(parts.bridge, ColocatedBridgeCommunicator)
        ):
            agree_image_counts(parts.bridge, inputs)
        delivered, counts = _deliver(parts, inputs, flow)
        rows = delivered.detach().requires_grad_(delivered.requires_grad)
    starts = [0] * microbatches

    def stage_inputs(m: int) -> torch.Tensor:
        if flow == "gather":
            return _gather_inputs(parts, mbs[m], rows, counts)
        emb, _ = _routed_inputs(parts, mbs[m], rows, starts[m])
        return emb

    if stage.is_first and flow == "routed" and rows is not None:
        at = 0  # each microbatch's first routed row: its local image positions, in order
        for m, mb in enumerate(mbs):
            starts[m] = at
            ids = mb.shard.input_ids
            is_image = ids == inputs.image_token_id
            if mb.shard.token_mask is not None:
                is_image = is_image & mb.shard.token_mask.to(is_image.device)
            if part.sequence_parallel and part.tp_size > 1:  # plain: each row's SP piece
                piece = is_image.shape[-1] // part.tp_size
                is_image = is_image.narrow(-1, part.tp_rank * piece, piece)
            at += int(is_image.sum())
        if at != rows.shape[0]:
            raise RuntimeError(f"routed {rows.shape[0]} rows but the microbatches hold {at}")
    loss = pipeline.step(
        microbatches,
        position_ids=[mb.shard.position_ids for mb in mbs],
        cu_seqlens=[mb.shard.cu_seqlens for mb in mbs] if inputs.packed else None,
        inputs=stage_inputs if stage.is_first else None,
        labels=[mb.shard.labels for mb in mbs] if stage.is_last else None,
        loss_mask=[mb.shard.loss_mask for mb in mbs] if stage.is_last else None,
    )
    if delivered is not None and delivered.requires_grad:
        grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        torch.autograd.backward(delivered, grad)
    return loss
