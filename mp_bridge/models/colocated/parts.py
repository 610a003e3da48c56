"""What a colocated step flow is, and what it runs with.

A *flow* is the order in which one colocated step moves image rows into the LLM's
CP/SP shards: :class:`~.gather.GatherFlow` (bridge each LLM DP batch, place images in
full-sequence embeddings, then partition) or :class:`~.routed.RoutedFlow` (partition the
integer tensors, embed the local tokens, route each image row straight to its shard).
Every flow is a :class:`MimoFlow`: ``flow.loss(parts, inputs)`` maps one step's parsed
inputs (:class:`~mp_bridge.models.data.inputs.StepInputs`, agreed over the grid) to the
global masked-mean token loss, using only what :class:`StepParts` hands it. With a
pipelined LLM (:mod:`.pipelined`) the flow also delivers the image rows to the first
stage (``flow.deliver``) and builds each :class:`Microbatch`'s stage-0 embeddings from
them (``flow.stage_inputs``): the step never asks which flow it runs. A new flow is one
more :class:`MimoFlow` subclass registered in :data:`~.mimo_options.FLOWS`; the model and
its door stay as they are.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mp_bridge.comm import BalancePlan, ImageBalancer, PartitionAdapter, ShardedBatch
from mp_bridge.layers import masked_mean
from mp_bridge.models.colocated.mimo_groups import MimoGroups
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.parallel.llm import TPLLM

__all__ = ["Microbatch", "MimoFlow", "StageFeed", "StepParts", "shard_loss"]


@dataclass(frozen=True)
class StepParts:
    """The modules and groups one colocated step runs on (this rank's shards).

    ``encoder``/``projection`` in the encoder grid (TP-replicated outputs), ``llm`` in
    the LLM grid, ``partition`` its CP (and SP) cut, ``groups`` every process group and
    the bridge; ``balancer`` (``ColocatedMimoModel(balance=True)``) spreads ragged images
    over the encoder DP replicas before encoding (``None``: each replica encodes its own).
    """

    encoder: nn.Module
    projection: nn.Module
    llm: TPLLM
    partition: PartitionAdapter
    groups: MimoGroups
    balancer: ImageBalancer | None = None

    @property
    def bridge(self):
        return self.groups.bridge

    def encode(self, images: torch.Tensor | RaggedImages) -> torch.Tensor:
        """Encoder + projection: ``[b_e, p, h]``, or ``[T_e, h]`` for ragged images."""
        return self.projection(self.encoder(images))

    def encode_balanced(
        self, images: torch.Tensor | RaggedImages
    ) -> tuple[torch.Tensor, BalancePlan | None]:
        """``(features, plan)``: with a balancer and ragged images, the images move whole to
        the replica the plan picks (one count all-gather over every encoder rank, one
        ``all_to_all_single`` of patch rows over the encoder DP group) and the encoder runs
        on what this replica received: ``features [T_after, h]``, rows of
        ``plan.tokens_after(replica)`` images in (source replica, index) order. Otherwise
        ``(encode(images), None)`` (uniform images weigh the same everywhere)."""
        if self.balancer is None or not isinstance(images, RaggedImages):
            return self.encode(images), None
        rows, plan = self.balancer.balance(images.tokens, images.tokens_per_image)
        sizes = torch.tensor(plan.tokens_after(self.balancer.replica), dtype=torch.int64)
        mine = RaggedImages(rows, sizes, torch.ones(len(sizes), dtype=torch.int64))
        return self.encode(mine), plan


class MimoFlow(abc.ABC):
    """One way of running the colocated step; ``name`` is what ``flow=`` accepts."""

    name: str

    @abc.abstractmethod
    def loss(self, parts: StepParts, inputs: StepInputs) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar) of this rank's parsed shards."""

    # ------------------------------------------------------ pipelined LLM (pp > 1)
    def check_pipelined(self, parts: StepParts, inputs: StepInputs) -> None:
        """``ValueError`` (local, before any collective) when this flow cannot run
        ``inputs`` with a pipelined LLM. A flow without the two calls below cannot."""
        if type(self).deliver is MimoFlow.deliver or (
            type(self).stage_inputs is MimoFlow.stage_inputs
        ):
            raise ValueError(
                f"a pipelined LLM runs flow 'gather' or 'routed', not {self!r} (a flow "
                "needs deliver and stage_inputs for a pipelined LLM)"
            )

    def deliver(
        self, parts: StepParts, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Phase 1 of a pipelined step, on every rank: ``(delivered, counts)``, this rank's
        image rows for the first stage (autograd-connected to the encoder; ``[0, ...]``
        off stage 0) and what :meth:`stage_inputs` needs besides (``None``: nothing)."""
        raise NotImplementedError(f"{self!r} has no per-microbatch delivery")

    def stage_inputs(self, parts: StepParts, feed: StageFeed) -> Callable[[int], torch.Tensor]:
        """Stage 0 only: ``m -> `` microbatch ``m``'s partitioned embeddings, its image rows
        taken from ``feed``. No collective but the LLM embedding's."""
        raise NotImplementedError(f"{self!r} has no per-microbatch delivery")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@dataclass(frozen=True)
class Microbatch:
    """One microbatch of a pipelined step: ``inputs`` (its samples' :class:`StepInputs`,
    unpadded; placement uses them), ``samples`` (its range in the LLM DP batch) and the
    partitioned integer tensors (``shard``: a ``ShardedBatch`` of the padded microbatch);
    ``pad`` tokens of capacity padding were appended (packed)."""

    inputs: StepInputs
    samples: range
    shard: ShardedBatch
    pad: int


@dataclass(frozen=True)
class StageFeed:
    """What stage 0 builds its microbatches' embeddings from: the ``microbatches``, the
    delivered image ``rows`` as a leaf (``None`` without images) and ``counts``, the
    second value of :meth:`MimoFlow.deliver`."""

    microbatches: Sequence[Microbatch]
    rows: torch.Tensor | None
    counts: torch.Tensor | None


def shard_loss(parts: StepParts, embeddings: torch.Tensor, shard: ShardedBatch) -> torch.Tensor:
    """LLM per-token loss of this rank's shard (``embeddings`` CP/SP-local, ``shard`` its
    :class:`ShardedBatch`) -> masked mean over the LLM DP x CP group (every flow's tail).

    Packed (``shard.cu_seqlens``): the 1-D local labels/mask become one ``b = 1`` row and
    attention gets ``shard.layout`` (parsed once, its mask built once for every layer).
    Collectives: the LLM's, then one all-reduce of the token count and sum
    (``masked_mean``).
    """
    labels, loss_mask = shard.labels, shard.loss_mask
    if shard.cu_seqlens is not None:
        labels, loss_mask = labels.reshape(1, -1), loss_mask.reshape(1, -1)
    # The layout (plain or packed) goes down to attention: its runs are parsed once per
    # step on the host, never read back from the position tensor.
    per_token = parts.llm.token_loss(
        embeddings, shard.position_ids, labels, cu_seqlens=shard.layout
    )
    return masked_mean(per_token, loss_mask, group=parts.groups.llm_dp_cp)
