"""The colocated MIMO model: encoder (TP x DP) -> bridge -> LLM (TP x CP x DP) -> loss.

Per step, on every rank of the shared grid:

1. check every rank's batch and agree on it and on whether images are present (one small
   all-gather over the encoder TP group, then over the encoder DP group, ``step_checks``):
   a bad batch on any rank is the same error on every rank, never a stranded peer;
2. encoder + projection on this rank's encoder DP shard ``images [b_e, p, patch_dim]``
   -> ``[b_e, p, h]`` (TP-replicated), or on ragged images (:class:`RaggedImages`, flat
   ``[T_e, patch_dim]`` tokens of the shard's samples) -> ``[T_e, h]``;
3. ``bridge.communicate`` -> this rank's LLM DP shard ``[b_l, p, h]``; ragged:
   ``bridge.communicate_ragged`` -> ``[T_l, h]`` and the LLM shard's per-sample counts;
4. text embeddings of ``input_ids [b_l, S]`` with image rows placed at the image tokens
   (ragged: sample ``i``'s tokens at its placeholders, which must match its count);
5. ``partition.shard`` -> CP (and SP) shards; LLM -> fp32 per-token loss ``[b_l, S/c]``;
6. ``masked_mean`` over the LLM DP x CP group: the global mean over every masked token.

Packed text (``forward(..., cu_seqlens=)``, :mod:`.packed`): ``input_ids [T_l]`` holds the
documents of this rank's LLM DP shard (document ``i`` = sample ``i``); step 4 embeds them
as one ``[1, T_l, h]`` row, step 5 shards with ``cu_seqlens`` (each document padded to its
CP cut) and the LLM's attention gets the padded global ``ShardedBatch.cu_seqlens``, so no
token attends across documents. The step check then also agrees on the packed layout:
two more small exchanges (every LLM DP replica's ranks must hold the same
``cu_seqlens``; see :func:`.step_checks.check_step`).

That is ``flow="gather"`` (the default). ``flow="routed"`` (:mod:`.routed`) reorders
steps 3-5: shard the integer tensors first, embed only the local text tokens, and
``bridge.route`` every image token straight to the CP (SP) shard that consumes it.

Because ``masked_mean``'s backward is the identity, each rank's backward yields the
gradient of the *global* loss restricted to its own tokens. :meth:`sync_gradients` then
sums encoder/projection gradients over the encoder DP group and LLM gradients over the
LLM DP x CP group (plus TP for sequence-parallel norms), one flattened all-reduce per
group, so an optimizer step equals the single-process step on the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from mp_bridge.comm import PartitionAdapter, group_size
from mp_bridge.grid import GridLayout
from mp_bridge.layers import masked_mean
from mp_bridge.models.colocated.flow import MimoFlow
from mp_bridge.models.colocated.groups import MimoGroups, grid_group, make_mimo_groups
from mp_bridge.models.colocated.routed import check_flow, routed_forward
from mp_bridge.models.colocated.step_checks import agree_image_counts, check_step
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.parallel.encoder import TPEncoder, TPProjection
from mp_bridge.models.parallel.llm import TPLLM

__all__ = ["ColocatedMimoModel"]


class ColocatedMimoModel(MimoFlow):
    """Wire ``encoder -> projection -> bridge -> placement -> partition -> llm -> loss``.

    Args:
        encoder, projection: TP modules in the encoder grid (``TPEncoder``/``TPProjection``).
        llm: a ``TPLLM`` in the LLM grid (its ``tp_group``/``cp_group`` are used).
        bridge: a ``ColocatedBridgeCommunicator(encoder_grid, llm_grid)``.
        partition: a ``PartitionAdapter`` with the LLM's CP (and TP for SP) groups.
        image_token_id: placeholder id whose positions receive image embeddings.
        encoder_dp_group: encoder DP group (grad sync, image-presence check).
        llm_dp_cp_group: LLM DP x CP group (loss denominator, grad sync).
        groups: the :class:`MimoGroups` these came from (DP groups default to its
            fields; :func:`destroy_colocated_mimo` frees it).
        flow: ``"gather"`` (default; the stages below: full-sequence embeddings, then
            partition) or ``"routed"`` (:mod:`.routed`: partition the integer tensors
            first, embed the local tokens, ``bridge.route`` each image token straight to
            its shard; no full-sequence activation or gradient).

    ``model(input_ids, labels, loss_mask, images=None, *, cu_seqlens=None)`` is
    :meth:`MimoFlow.forward` on this rank's shards (LLM DP shard of the text, ``[b, S]``
    rows or packed ``[T]`` documents with ``cu_seqlens``; encoder DP shard of the images,
    uniform or :class:`RaggedImages`); the stages below implement it. The model creates no
    process group. A DP group left out (and not in ``groups``) is
    looked up on the bridge's grids (``bridge.src_grid.get_pg('dp')``,
    ``bridge.dest_grid.get_pg(['dp', 'cp'])``), so the plain signature
    ``ColocatedMimoModel(encoder, projection, llm, bridge, partition, image_token_id=i)``
    is correct on grids that hold those groups (``make_grid(..., create=...)`` or
    :func:`make_mimo_groups`); otherwise ``ValueError`` naming the fix. With a real
    bridge, every group is then checked against the bridge's layouts before any
    collective (``ValueError`` naming the group, its ranks and the expected ones).
    """

    def __init__(
        self,
        encoder: nn.Module,
        projection: nn.Module,
        llm: nn.Module,
        bridge,
        partition,
        *,
        image_token_id: int,
        encoder_dp_group: dist.ProcessGroup | None = None,
        llm_dp_cp_group: dist.ProcessGroup | None = None,
        groups: MimoGroups | None = None,
        flow: str = "gather",
    ):
        super().__init__()
        self.flow = check_flow(flow)
        if isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
            raise TypeError(f"image_token_id={image_token_id!r} must be an int vocab id")
        if not 0 <= image_token_id < llm.cfg.vocab_size:
            raise ValueError(
                f"image_token_id={image_token_id} is outside the LLM vocab "
                f"[0, {llm.cfg.vocab_size}); use the id of the image placeholder token"
            )
        if groups is not None and not isinstance(groups, MimoGroups):
            raise TypeError(f"groups must be a MimoGroups (make_mimo_groups), got {groups!r}")
        self.encoder, self.projection, self.llm = encoder, projection, llm
        self.bridge, self.partition = bridge, partition
        self.image_token_id = image_token_id
        self.groups = groups
        if groups is not None and encoder_dp_group is None:
            encoder_dp_group = groups.encoder_dp
        if groups is not None and llm_dp_cp_group is None:
            llm_dp_cp_group = groups.llm_dp_cp
        self.encoder_dp_group = encoder_dp_group
        self.llm_dp_cp_group = llm_dp_cp_group
        self._destroyed = False
        plan = getattr(bridge, "plan", None)  # None: a single-process stand-in bridge
        if plan is not None:
            self._find_missing_groups(plan)
            self._check_groups(plan)

    # ------------------------------------------------------------------ groups
    def _find_missing_groups(self, plan) -> None:
        """Take a DP group left out from the bridge's grid (local lookup, no collective)."""
        rank = dist.get_rank()
        if rank not in plan.src.ranks:
            raise ValueError(
                f"rank {rank} is outside the bridged grids {plan.src!r}; build "
                f"ColocatedMimoModel only on ranks {list(plan.src.ranks)}"
            )
        for name, (grid_name, layout, axes) in {
            "encoder_dp_group": ("src_grid", plan.src, ("dp",)),
            "llm_dp_cp_group": ("dest_grid", plan.dest, ("dp", "cp")),
        }.items():
            if getattr(self, name) is not None or len(_members_of(layout, axes, rank)) == 1:
                continue
            grid = getattr(self.bridge, grid_name, None)
            if not hasattr(grid, "get_pg"):
                raise ValueError(
                    f"{name} was not given and the bridge's {grid_name} holds no process "
                    f"groups; pass {name}={_WHERE[name]} or build the model with "
                    "build_colocated_mimo / make_mimo_groups"
                )
            try:
                setattr(self, name, grid_group(grid, axes))
            except ValueError as exc:
                raise ValueError(f"{name} was not given and {exc}") from None

    def _check_groups(self, plan) -> None:
        """Every group must hold the ranks the bridge's layouts say (local checks)."""
        rank = dist.get_rank()
        checks = [
            ("encoder.tp_group", self.encoder.tp_group, plan.src, ("tp",)),
            ("llm.tp_group", self.llm.tp_group, plan.dest, ("tp",)),
            ("llm.cp_group", self.llm.cp_group, plan.dest, ("cp",)),
            ("partition.cp_group", self.partition.cp_group, plan.dest, ("cp",)),
            ("encoder_dp_group", self.encoder_dp_group, plan.src, ("dp",)),
            ("llm_dp_cp_group", self.llm_dp_cp_group, plan.dest, ("dp", "cp")),
        ]
        if self.partition.sequence_parallel:
            checks.append(("partition.tp_group", self.partition.tp_group, plan.dest, ("tp",)))
        for name, group, layout, axes in checks:
            expected = _members_of(layout, axes, rank)
            got = [rank] if group is None else sorted(dist.get_process_group_ranks(group))
            if got != expected:
                raise ValueError(
                    f"{name} on rank {rank} holds ranks {got} but the layout {layout!r} "
                    f"puts this rank's {'x'.join(axes)} group at {expected}; pass the "
                    f"grid's group, e.g. {_WHERE.get(name, 'grid.get_pg(...)')}"
                )

    def destroy(self) -> None:
        """Mark the model unusable (``forward`` raises). It owns no process group: the
        bridge, the grids or its :class:`MimoGroups` do
        (see :func:`~mp_bridge.models.destroy_colocated_mimo`)."""
        self._destroyed = True

    # ------------------------------------------------------------------ stages
    def forward(
        self, input_ids, labels, loss_mask, images=None, *, cu_seqlens=None
    ) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar) of this rank's shards, by ``flow``."""
        if self.flow == "routed":
            return routed_forward(self, input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)
        return super().forward(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)

    # flow="gather" (MimoFlow.forward):
    # check_step -> encode -> bridge_images -> place -> mean_token_loss.
    def check_step(self, input_ids, labels, loss_mask, images, *, cu_seqlens=None) -> bool:
        """Every rank's local checks, agreed over the grid with whether images are present
        (and, packed, on each LLM DP replica's ``cu_seqlens``)."""
        if self._destroyed:
            raise RuntimeError("forward() after destroy(); build a new ColocatedMimoModel")
        has_images = self._check_step(input_ids, labels, loss_mask, images, cu_seqlens)
        gather = self.flow == "gather" and hasattr(self.bridge, "world_group")
        if gather and has_images and isinstance(images, RaggedImages):
            # route checks the counts itself; the gather flow asks every rank here.
            agree_image_counts(self.bridge, input_ids, images, self.image_token_id, cu_seqlens)
        return has_images

    def bridge_images(self, image, images):
        """Encoder DP batch -> LLM DP batch: ``[b_e, p, h] -> [b_l, p, h]``, or ragged
        ``[T_e, h] -> [T_l, h]`` with the LLM batch's ``[b_l]`` token counts."""
        if isinstance(images, RaggedImages):
            return self.bridge.communicate_ragged(image, images.tokens_per_sample)
        return self.bridge.communicate(image), None

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llm.embed_tokens(input_ids)

    def mean_token_loss(self, embeddings, labels, loss_mask, *, cu_seqlens=None) -> torch.Tensor:
        """Partition into CP (and SP) shards, LLM per-token loss, global masked mean
        (packed: ``embeddings [1, T, h]``, each document padded to its cut)."""
        shard = self.partition.shard(
            embeddings, labels=labels, loss_mask=loss_mask, cu_seqlens=cu_seqlens
        )
        return self.shard_loss(shard.embeddings, shard)

    def shard_loss(self, embeddings, shard) -> torch.Tensor:
        """LLM per-token loss of this rank's shard (``embeddings`` CP/SP-local, ``shard``
        its :class:`ShardedBatch`) -> masked mean over the LLM DP x CP group (both flows).
        Packed (``shard.cu_seqlens``): the 1-D local labels/mask become one ``b = 1`` row
        and attention gets the padded global ``cu_seqlens``."""
        labels, loss_mask, cu = shard.labels, shard.loss_mask, shard.cu_seqlens
        if cu is not None:
            labels, loss_mask = labels.reshape(1, -1), loss_mask.reshape(1, -1)
        per_token = self.llm.token_loss(embeddings, shard.position_ids, labels, cu_seqlens=cu)
        return masked_mean(per_token, loss_mask, group=self.llm_dp_cp_group)

    def _check_step(self, input_ids, labels, loss_mask, images, cu_seqlens=None) -> bool:
        """Every rank's per-rank checks, agreed in one exchange (``step_checks``): a bad
        batch on any rank is the same error on every rank, never a hang. Returns whether
        images are present (on every rank). Packed: each LLM DP replica (its TP x CP
        ranks) must also hold one ``cu_seqlens``."""
        cfg = self.llm.cfg
        return check_step(
            (self.encoder.tp_group, self.encoder_dp_group),  # together: the whole grid
            next(self.llm.parameters()).device,
            input_ids,
            labels,
            loss_mask,
            images,
            cu_seqlens=cu_seqlens,
            replica_groups=(self.llm.tp_group, self.llm.cp_group),
            vocab_size=cfg.vocab_size,
            image_token_id=self.image_token_id,
            num_patches=cfg.num_patches,
            patch_dim=cfg.patch_dim,
        )

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_full(cls, reference, encoder_grid, llm_grid, **kwargs) -> ColocatedMimoModel:
        """Shard a single-process ``ReferenceMimo`` over the groups of
        ``make_mimo_groups(encoder_grid, llm_grid)``; see :meth:`from_groups` (collective)."""
        _check_tp(reference.cfg, *(GridLayout.from_grid(g) for g in (encoder_grid, llm_grid)))
        return cls.from_groups(reference, make_mimo_groups(encoder_grid, llm_grid), **kwargs)

    @classmethod
    def from_groups(
        cls,
        reference,
        groups: MimoGroups,
        *,
        sequence_parallel: bool = False,
        fused_loss: bool = False,
        device: torch.device | None = None,
        flow: str = "gather",
    ) -> ColocatedMimoModel:
        """This rank's shards of ``reference`` on ``groups`` (no collective; the model
        keeps ``groups``, which :func:`destroy_colocated_mimo` frees). ``flow``: see
        the class."""
        cfg = reference.cfg
        _check_tp(cfg, groups.bridge.plan.src, groups.bridge.plan.dest)
        enc_tp, llm_tp, llm_cp = groups.encoder_tp, groups.llm_tp, groups.llm_cp
        llm = TPLLM.from_full(
            reference.llm, cfg, tp_group=llm_tp, cp_group=llm_cp,
            sequence_parallel=sequence_parallel, fused_loss=fused_loss, device=device,
        )  # fmt: skip
        return cls(
            TPEncoder.from_full(reference.encoder, cfg, tp_group=enc_tp, device=device),
            TPProjection.from_full(reference.projection, cfg, tp_group=enc_tp, device=device),
            llm,
            groups.bridge,
            PartitionAdapter(
                cp_group=llm_cp, tp_group=llm_tp, sequence_parallel=llm.sequence_parallel
            ),
            image_token_id=cfg.image_token_id,
            groups=groups,
            flow=flow,
        )

    def to_full(self) -> dict[str, torch.Tensor]:
        """Full tensors keyed like ``ReferenceMimo.state_dict()`` (TP all-gathers; collective)."""
        return {
            f"{part}.{name}": tensor
            for part in ("encoder", "projection", "llm")
            for name, tensor in getattr(self, part).to_full().items()
        }

    # ------------------------------------------------------------ gradient sync
    def gradient_buckets(self) -> list[tuple[dist.ProcessGroup, list[nn.Parameter]]]:
        """``(group, params)`` pairs whose gradients :meth:`sync_gradients` sums."""
        encoder_params = [*self.encoder.parameters(), *self.projection.parameters()]
        llm_params = list(self.llm.parameters())
        sp_params = [p for p in llm_params if getattr(p, "sequence_parallel", False)]
        buckets = [
            (self.encoder_dp_group, encoder_params),
            (self.llm_dp_cp_group, llm_params),
            (self.llm.tp_group, sp_params),
        ]
        return [(g, ps) for g, ps in buckets if ps and group_size(g) > 1]

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Sum partial gradients across replicas (call after ``backward``, before ``step``).

        Collectives: one all-reduce(SUM) per bucket. A bucket whose parameters all have no
        gradient (the encoder on a text-only step, agreed by every rank) is skipped; a
        missing gradient next to present ones counts as zeros, so ranks never diverge.
        """
        for group, params in self.gradient_buckets():
            _all_reduce_grads(params, group)


#: Where a caller finds each group on its grids.
_WHERE = {
    "encoder_dp_group": "encoder_grid.get_pg('dp')",
    "llm_dp_cp_group": "llm_grid.get_pg(['dp', 'cp'])",
}


def _check_tp(cfg, encoder: GridLayout, llm: GridLayout) -> None:
    """The config's head counts must split over both TP sizes (local check)."""
    cfg.check_tp(encoder_tp=encoder.dim("tp"), llm_tp=llm.dim("tp"))


def _members_of(layout, axes: tuple[str, ...], rank: int) -> list[int]:
    """Sorted ranks of ``rank``'s group over ``axes`` (axes the layout lacks have size 1)."""
    present = [a for a in axes if a in layout.dim_names]
    return sorted(layout.group_of(rank, present)) if present else [rank]


def _all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    params = list(params)
    if all(p.grad is None for p in params):
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    # One flat buffer, one all-reduce (public ops: cat of flattened views, then split).
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))
