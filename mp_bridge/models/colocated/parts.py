"""What a colocated step flow is, and what it runs with.

A *flow* is the order in which one colocated step moves image rows into the LLM's
CP/SP shards: :class:`~.gather.GatherFlow` (bridge each LLM DP batch, place images in
full-sequence embeddings, then partition) or :class:`~.routed.RoutedFlow` (partition the
integer tensors, embed the local tokens, route each image row straight to its shard).
Every flow is a :class:`MimoFlow`: ``flow.loss(parts, inputs)`` maps one step's parsed
inputs (:class:`~mp_bridge.models.data.inputs.StepInputs`, agreed over the grid) to the
global masked-mean token loss, using only what :class:`StepParts` hands it. A new flow
(e.g. a pipelined LLM over microbatches of ``inputs``) is one more :class:`MimoFlow`
subclass registered in :data:`~.flows.FLOWS`; the model and its door stay as they are.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from mp_bridge.comm import BalancePlan, ImageBalancer, PartitionAdapter, ShardedBatch
from mp_bridge.layers import masked_mean
from mp_bridge.models.colocated.mimo_groups import MimoGroups
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import StepInputs
from mp_bridge.models.parallel.llm import TPLLM

__all__ = ["MimoFlow", "StepParts", "shard_loss"]


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

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def shard_loss(parts: StepParts, embeddings: torch.Tensor, shard: ShardedBatch) -> torch.Tensor:
    """LLM per-token loss of this rank's shard (``embeddings`` CP/SP-local, ``shard`` its
    :class:`ShardedBatch`) -> masked mean over the LLM DP x CP group (every flow's tail).

    Packed (``shard.cu_seqlens``): the 1-D local labels/mask become one ``b = 1`` row and
    attention gets ``shard.layout`` (parsed once, its mask built once for every layer).
    Collectives: the LLM's, then one all-reduce of the token count and sum
    (``masked_mean``).
    """
    labels, loss_mask, cu = shard.labels, shard.loss_mask, None
    if shard.cu_seqlens is not None:
        labels, loss_mask = labels.reshape(1, -1), loss_mask.reshape(1, -1)
        cu = shard.layout
    per_token = parts.llm.token_loss(embeddings, shard.position_ids, labels, cu_seqlens=cu)
    return masked_mean(per_token, loss_mask, group=parts.groups.llm_dp_cp)
