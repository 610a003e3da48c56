"""The colocated step with a pipelined LLM (LLM PP > 1) over ``M`` microbatches.

Three phases on every rank of the shared grid (:func:`pipelined_step`):

1. **encoder forward once** over this rank's encoder DP batch, then **delivery to
   stage 0** by the flow (``flow.deliver``): the gather flow bridges the whole LLM DP
   batch's image rows (``communicate`` / ``communicate_ragged``: ``[b_l, p, h]`` /
   ``[T_l, h]`` on stage 0, ``[0, ...]`` on a later stage); the routed flow routes them
   straight to the first stage's CP/SP shard (``route``: ``[n_local, h]``, shard order of
   the whole batch).
2. ``rows = delivered.detach().requires_grad_()``; the LLM runs under
   :class:`~mp_bridge.models.parallel.pipeline.LLMPipeline` (1F1B, or GPipe when
   ``M < PP``) over the microbatches (:func:`split_microbatches`): stage 0 gets each
   microbatch's embeddings from the flow (``flow.stage_inputs``: its ids embedded, its
   slice of ``rows`` placed; leaves: their gradient accumulates through the schedule's
   backward), every stage gets the position ids, the last stage the labels and loss
   mask.
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
``ValueError`` (``flow.check_pipelined``; use the gather flow).
"""

from __future__ import annotations

import dataclasses

import torch

from mp_bridge.models.colocated.parts import Microbatch, MimoFlow, StageFeed, StepParts
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.parallel.pipeline import LLMPipeline
from mp_bridge.models.parallel.pipeline_capacity import agree_capacity, packed_length, pad_packed_to

__all__ = ["Microbatch", "pipelined_step", "split_microbatches"]


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
        group = parts.bridge.world_group
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


def pipelined_step(
    parts: StepParts,
    inputs: StepInputs,
    *,
    pipeline: LLMPipeline,
    microbatches: int,
    flow: MimoFlow,
) -> torch.Tensor:
    """One training step's forward and backward (module docstring); the detached loss."""
    flow.check_pipelined(parts, inputs)
    mbs = split_microbatches(parts, inputs, microbatches)
    stage = pipeline.stage
    delivered = rows = counts = None
    if inputs.has_images:
        delivered, counts = flow.deliver(parts, inputs)
        rows = delivered.detach().requires_grad_(delivered.requires_grad)
    loss = pipeline.step(
        microbatches,
        position_ids=[mb.shard.position_ids for mb in mbs],
        cu_seqlens=[mb.shard.layout for mb in mbs] if inputs.packed else None,
        inputs=flow.stage_inputs(parts, StageFeed(mbs, rows, counts)) if stage.is_first else None,
        labels=[mb.shard.labels for mb in mbs] if stage.is_last else None,
        loss_mask=[mb.shard.loss_mask for mb in mbs] if stage.is_last else None,
    )
    if delivered is not None and delivered.requires_grad:
        grad = rows.grad if rows.grad is not None else torch.zeros_like(rows)
        torch.autograd.backward(delivered, grad)
    return loss
