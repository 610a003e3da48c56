"""The colocated MIMO model: encoder (TP x DP) -> bridge -> LLM (TP x CP x DP) -> loss.

Per step, on every rank of the shared grid:

1. parse this rank's inputs once (:func:`~mp_bridge.models.data.inputs.parse_step_inputs`:
   shapes, ids, ``cu_seqlens``, placeholder counts) and agree on the outcome over the
   whole grid (:func:`~.step_agreement.agree_step_inputs`): a bad batch on any rank is the
   same error on every rank, never a stranded peer;
2. the flow (:class:`~.parts.MimoFlow`, chosen once at construction) runs the step on
   the parsed inputs: :class:`~.gather.GatherFlow` (bridge each LLM DP batch, place the
   images in full-sequence embeddings, partition) or :class:`~.routed.RoutedFlow`
   (partition the integer tensors, route each image row straight to its CP/SP shard);
3. the LLM's per-token loss -> ``masked_mean`` over the LLM DP x CP group: the global
   mean over every masked token.

Packed text (``forward(..., cu_seqlens=)``): ``input_ids [T_l]`` holds the documents of
this rank's LLM DP shard (document ``i`` = sample ``i``); the agreement then also checks
that every rank of an LLM DP replica holds the same ``cu_seqlens``.

Because ``masked_mean``'s backward is the identity, each rank's backward yields the
gradient of the *global* loss restricted to its own tokens. :meth:`sync_gradients` then
sums encoder/projection gradients over the encoder DP group and LLM gradients over the
LLM DP x CP group (plus TP for sequence-parallel norms), one flattened all-reduce per
group, so an optimizer step equals the single-process step on the global batch. A
pipelined LLM with a tied head (``cfg.tie_embeddings``, pp > 1) also sums the gradients of
the first stage's embedding and the last stage's copy over ``groups.llm_embed``, after
the DP x CP sum: both copies then hold the single-process gradient of the tied weight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from torch import nn

from mp_bridge.checks import FrozenSpec, agree, agreed, check_bool, check_int
from mp_bridge.comm import ImageBalancer, PartitionAdapter, group_size
from mp_bridge.grid import GridLayout
from mp_bridge.models.colocated.legacy import DP_NAMES, legacy_groups
from mp_bridge.models.colocated.mimo_groups import MimoGroups, check_members, make_mimo_groups
from mp_bridge.models.colocated.mimo_options import MimoOptions, parse_flow
from mp_bridge.models.colocated.parts import MimoFlow, StepParts
from mp_bridge.models.colocated.pipelined import pipelined_step
from mp_bridge.models.colocated.step_agreement import agree_step_inputs
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.inputs import BatchSpec, StepInputs, parse_step_inputs
from mp_bridge.models.parallel.encoder import TPEncoder, TPProjection
from mp_bridge.models.parallel.llm import TPLLM
from mp_bridge.models.parallel.llm_stages import TPLLMStage
from mp_bridge.models.parallel.pipeline import LLMPipeline
from mp_bridge.models.parallel.shard_init import init_shards_

__all__ = ["ColocatedMimoModel"]


class ColocatedMimoModel(nn.Module):
    """Wire ``encoder -> projection -> bridge -> placement -> partition -> llm -> loss``.

    Args:
        encoder, projection: TP modules in the encoder grid (``TPEncoder``/``TPProjection``).
        llm: a ``TPLLM`` in the LLM grid.
        groups: every process group and the bridge (:func:`make_mimo_groups`, or
            :meth:`MimoGroups.local` for one process); the modules must use its groups
            (checked against the bridge's layouts before any collective: ``ValueError``
            naming the group, its ranks and the expected ones). The model creates no
            process group and builds its ``PartitionAdapter`` from ``groups``.
        image_token_id: placeholder id whose positions receive image embeddings.
        flow: ``"gather"`` (default), ``"routed"`` or a :class:`MimoFlow` object (see
            :mod:`.gather`, :mod:`.routed`), parsed once here.
        balance: spread ragged images over the encoder DP replicas by estimated cost
            before encoding (:class:`~mp_bridge.comm.bridge.execution.balancer.ImageBalancer`, cost
            ``t² + c·t``, ``c = cfg.encoder_cost_c``); the routed flow then sends
            each feature row straight to its shard, the gather flow returns it to its
            source replica first. Uniform images and one encoder replica: nothing moves.

    ``model(input_ids, labels, loss_mask, images=None, *, cu_seqlens=None)`` on this
    rank's shards: the LLM DP shard of the text (``[b, S]`` rows, or packed ``[T]``
    documents with ``cu_seqlens``) and the encoder DP shard of the images (uniform
    ``[b, p, patch_dim]`` or :class:`RaggedImages`); returns the global masked-mean token
    loss (fp32 scalar).

    Pipelined LLM (``llm`` a :class:`TPLLMStage`, ``groups.llm_pp`` its stages): the
    step runs over ``microbatches`` microbatches under a pipeline schedule, which runs the
    backward itself, so call :meth:`train_step` (forward and backward, the detached
    loss) instead of ``model(...)`` then ``loss.backward()``; see :mod:`.pipelined`.
    ``schedule``: ``"auto"``, ``"1f1b"`` or ``"gpipe"`` (:class:`LLMPipeline`).

    Deprecated form (one release, ``DeprecationWarning``; :mod:`.legacy`):
    ``ColocatedMimoModel(encoder, projection, llm, bridge, partition, *, image_token_id,
    encoder_dp_group=None, llm_dp_cp_group=None, groups=None, flow=...)``.
    """

    def __init__(
        self,
        encoder: nn.Module,
        projection: nn.Module,
        llm: TPLLM,
        groups: MimoGroups | None = None,
        partition: PartitionAdapter | None = None,
        /,
        *,
        image_token_id: int,
        flow: str | MimoFlow = "gather",
        microbatches: int = 1,
        schedule: str = "auto",
        balance: bool = False,
        **deprecated,
    ):
        super().__init__()
        self._flow = parse_flow(flow)
        self.microbatches = check_int("microbatches", microbatches, low=1)
        check_bool("balance", balance)
        if balance and llm.cfg.placeholders_per_image != llm.cfg.num_patches:
            raise ValueError(
                f"balance=True moves encoder outputs by their input token counts, but this "
                f"tower emits image_placeholders={llm.cfg.placeholders_per_image} per image of "
                f"num_patches={llm.cfg.num_patches}; use balance=False"
            )
        cfg = llm.cfg  # BatchSpec checks image_token_id against the LLM vocab
        self.spec = BatchSpec.of(cfg, image_token_id)
        if groups is None and set(deprecated) == {"groups"} and partition is None:
            groups = deprecated.pop("groups")  # the new form, groups by keyword
        dp_names = {"encoder_dp": "groups.encoder_dp", "llm_dp_cp": "groups.llm_dp_cp"}
        if isinstance(groups, MimoGroups) and partition is None and not deprecated:
            partition = PartitionAdapter(
                cp_group=groups.llm_cp, tp_group=groups.llm_tp,
                sequence_parallel=llm.sequence_parallel,
            )  # fmt: skip
        else:  # the deprecated form: (encoder, projection, llm, bridge, partition, ...)
            groups = legacy_groups(groups, partition, encoder=encoder, llm=llm,
                                   keywords=deprecated)  # fmt: skip
            dp_names = DP_NAMES
        used = [
            ("encoder.tp_group", encoder.tp_group, "encoder_tp"),
            ("projection.tp_group", projection.tp_group, "encoder_tp"),
            ("llm.tp_group", llm.tp_group, "llm_tp"),
            ("llm.cp_group", llm.cp_group, "llm_cp"),
            ("partition.cp_group", partition.cp_group, "llm_cp"),
            (dp_names["encoder_dp"], groups.encoder_dp, "encoder_dp"),
            (dp_names["llm_dp_cp"], groups.llm_dp_cp, "llm_dp_cp"),
        ]
        if partition.sequence_parallel:
            used.append(("partition.tp_group", partition.tp_group, "llm_tp"))
        self.pipeline = None
        if isinstance(llm, TPLLMStage):
            used.append(("groups.llm_pp", groups.llm_pp, "llm_pp"))
        check_members(groups, used)
        self._embed_group = None
        if isinstance(llm, TPLLMStage):
            self.pipeline = LLMPipeline(
                llm, pp_group=groups.llm_pp, loss_group=groups.llm_dp_cp, schedule=schedule
            )
            if llm.tied_parameters():
                self._embed_group = groups.embedding_group()
        elif microbatches != 1:
            raise ValueError(
                f"microbatches={microbatches} needs a pipelined LLM (a TPLLMStage on an LLM "
                f"grid with pp > 1); use microbatches=1"
            )
        self.encoder, self.projection, self.llm = encoder, projection, llm
        self.partition, self.groups = partition, groups
        self.image_token_id = image_token_id
        self._destroyed = False
        self.balancer = None
        if balance and groups.bridge.plan is not None:  # one process: nothing to balance
            self.balancer = ImageBalancer(
                dp_group=groups.encoder_dp, count_group=groups.bridge.world_group,
                c=cfg.encoder_cost_c,
            )  # fmt: skip

    @property
    def flow(self) -> MimoFlow:
        """The step's flow object (assign a name or a :class:`MimoFlow` to switch)."""
        return self._flow

    @flow.setter
    def flow(self, flow: str | MimoFlow) -> None:
        self._flow = parse_flow(flow)

    @property
    def bridge(self):
        return self.groups.bridge

    @property
    def encoder_dp_group(self) -> dist.ProcessGroup | None:
        return self.groups.encoder_dp

    @property
    def llm_dp_cp_group(self) -> dist.ProcessGroup | None:
        return self.groups.llm_dp_cp

    def checkpoint_grids(self) -> dict[str, HyperCommGrid | None]:
        """The grids a checkpoint records (``mp_bridge.checkpoint.save`` asks every model
        for this method): ``encoder`` and ``llm`` (``None`` in one process, or when the
        groups came from elsewhere)."""
        return {"encoder": self.groups.encoder_grid, "llm": self.groups.llm_grid}

    def destroy(self) -> None:
        """Mark the model unusable (``forward`` raises). It owns no process group: its
        :class:`MimoGroups` does (see :func:`~mp_bridge.models.destroy_colocated_mimo`)."""
        self._destroyed = True

    # ------------------------------------------------------------------ step
    @agreed("mp_bridge.models.ColocatedMimoModel.forward")
    def forward(
        self, input_ids, labels, loss_mask, images=None, *, cu_seqlens=None
    ) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar) of this rank's shards (see the class)."""
        if self.pipeline is not None:
            raise RuntimeError(
                "a pipelined LLM runs its backward inside the schedule: call "
                "model.train_step(input_ids, labels, loss_mask, images, cu_seqlens=...) instead"
            )
        inputs = self.parse_and_agree(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)
        return self.flow.loss(self.parts(), inputs)

    @agreed("mp_bridge.models.ColocatedMimoModel.train_step")
    def train_step(
        self, input_ids, labels, loss_mask, images=None, *, cu_seqlens=None
    ) -> torch.Tensor:
        """Forward and backward of one step; returns the loss detached, equal on every rank.

        Without PP: ``forward`` then ``backward``. With a pipelined LLM: the three phases
        of :mod:`.pipelined` over ``microbatches``. Gradients are partial as after
        ``backward``: call :meth:`sync_gradients` next."""
        if self.pipeline is None:
            loss = self(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)
            loss.backward()
            return loss.detach()
        inputs = self.parse_and_agree(input_ids, labels, loss_mask, images, cu_seqlens=cu_seqlens)
        return pipelined_step(
            self.parts(), inputs, pipeline=self.pipeline, microbatches=self.microbatches,
            flow=self.flow,
        )  # fmt: skip

    def parts(self) -> StepParts:
        """What the flow runs with."""
        return StepParts(
            self.encoder, self.projection, self.llm, self.partition, self.groups, self.balancer
        )

    @agreed("mp_bridge.models.ColocatedMimoModel.parse_and_agree")
    def parse_and_agree(
        self, input_ids, labels, loss_mask, images=None, *, cu_seqlens=None
    ) -> StepInputs:
        """This rank's inputs parsed once, agreed over the grid (:mod:`.step_agreement`).
        Collectives: one small all-gather per grid group (packed: three)."""
        if self._destroyed:
            raise RuntimeError("forward() after destroy(); build a new ColocatedMimoModel")
        plan = self.groups.bridge.plan  # None: one process (LocalBridge)
        dp = (1, 1) if plan is None else (plan.src.axis_size("dp"), plan.dest.axis_size("dp"))
        return agree_step_inputs(
            lambda: parse_step_inputs(
                input_ids, labels, loss_mask, images, cu_seqlens, self.spec,
                images_of_text=False, dp_sizes=dp,
            ),
            grid_groups=(self.groups.encoder_tp, self.groups.encoder_dp),  # the whole grid
            replica_groups=(self.groups.llm_tp, self.groups.llm_cp),  # one LLM DP replica
            device=next(self.llm.parameters()).device,
        )  # fmt: skip

    # ------------------------------------------------------------------ weights
    @classmethod
    def from_full(cls, reference, encoder_grid, llm_grid, **kwargs) -> ColocatedMimoModel:
        """Shard a single-process ``ReferenceMimo`` over the groups of
        ``make_mimo_groups(encoder_grid, llm_grid)``; see :meth:`from_groups` (collective)."""
        cfg = reference if isinstance(reference, MimoConfig) else reference.cfg
        _check_tp(
            cfg, *(GridLayout.from_grid(g) for g in (encoder_grid, llm_grid)),
            kwargs.get("cp_comm", "all_gather"),
        )  # fmt: skip
        return cls.from_groups(reference, make_mimo_groups(encoder_grid, llm_grid), **kwargs)

    @classmethod
    def from_groups(cls, reference, groups: MimoGroups, **options) -> ColocatedMimoModel:
        """This rank's shards of ``reference`` on ``groups`` (no collective; the model
        keeps ``groups``, which :func:`destroy_colocated_mimo` frees). ``options``: the
        build options of :class:`~.mimo_options.MimoOptions` (``flow``, ``microbatches``,
        ``schedule``, ``balance``: see the class); with ``groups.llm_pp`` (LLM pp > 1) the
        LLM is this rank's :class:`TPLLMStage`. The one builder: ``from_full`` and
        ``build_colocated_mimo`` end here."""
        opts = MimoOptions(**options)
        cfg = reference if isinstance(reference, MimoConfig) else reference.cfg
        enc_tp, llm_tp, llm_cp = groups.encoder_tp, groups.llm_tp, groups.llm_cp
        device, sp = opts.device, opts.sequence_parallel

        def part(kind, name: str, **kwargs):
            """``reference``'s part ``name`` sharded, or (a config) this rank's shards only,
            seeded per shard (:func:`init_shards_`), with no global RNG draw."""
            if not isinstance(reference, MimoConfig):
                return kind.from_full(getattr(reference, name), cfg, device=device, **kwargs)
            with torch.random.fork_rng(devices=[]):
                module = kind(cfg, device=device, **kwargs)
            init_shards_(module, prefix=f"{name}.")
            return module if device is None else module.to(device)

        if group_size(groups.llm_pp) > 1:
            if opts.fused_loss:
                raise ValueError("fused_loss=True is not supported with a pipelined LLM (pp > 1)")
            llm = part(
                TPLLMStage, "llm", stage=dist.get_rank(groups.llm_pp),
                n_stages=group_size(groups.llm_pp), tp_group=llm_tp, cp_group=llm_cp,
                sequence_parallel=sp, cp_comm=opts.cp_comm,
            )  # fmt: skip
        else:
            llm = part(
                TPLLM, "llm", tp_group=llm_tp, cp_group=llm_cp, sequence_parallel=sp,
                fused_loss=opts.fused_loss, cp_comm=opts.cp_comm,
            )  # fmt: skip
        return cls(
            part(TPEncoder, "encoder", tp_group=enc_tp),
            part(TPProjection, "projection", tp_group=enc_tp),
            llm,
            groups,
            image_token_id=cfg.image_token_id,
            **opts.model_keywords(),
        )

    def to_full(self) -> dict[str, torch.Tensor]:
        """Full tensors keyed like ``ReferenceMimo.state_dict()`` (TP all-gathers; collective).
        With a pipelined LLM: the LLM names of this rank's stage only."""
        return {
            f"{part}.{name}": tensor
            for part in ("encoder", "projection", "llm")
            for name, tensor in getattr(self, part).to_full().items()
        }

    # ------------------------------------------------------------ gradient sync
    def gradient_buckets(self) -> list[tuple[dist.ProcessGroup, list[nn.Parameter]]]:
        """``(group, params)`` pairs whose gradients :meth:`sync_gradients` sums, in order;
        the last, on the first and last stage of a tied pipeline: the embedding copy over
        the embedding group (after its DP x CP sum)."""
        encoder_params = [*self.encoder.parameters(), *self.projection.parameters()]
        llm_params = list(self.llm.parameters())
        sp_params = [p for p in llm_params if getattr(p, "sequence_parallel", False)]
        buckets = [
            (self.groups.encoder_dp, encoder_params),
            (self.groups.llm_dp_cp, llm_params),
            (self.llm.tp_group, sp_params),
            (self._embed_group, self.llm.tied_parameters() if self.pipeline else []),
        ]
        return [(g, ps) for g, ps in buckets if ps and group_size(g) > 1]

    @torch.no_grad()
    @agreed("mp_bridge.models.ColocatedMimoModel.sync_gradients")
    def sync_gradients(self) -> None:
        """Sum partial gradients across replicas (call after ``backward``, before ``step``).

        Collectives: one all-reduce(SUM) per bucket. A bucket whose parameters all have no
        gradient (the encoder on a text-only step, agreed by every rank) is skipped; a
        missing gradient next to present ones counts as zeros, so ranks never diverge.
        The ranks of each bucket's group agree first on what they sum (:class:`_GradSpec`).
        """
        for group, params in self.gradient_buckets():
            _all_reduce_grads(params, group)


def _check_tp(cfg, encoder: GridLayout, llm: GridLayout, cp_comm: str) -> None:
    """The config's head counts must split over both TP sizes, and under ``cp_comm="a2a"``
    each TP rank's heads over CP (local check, before any group is created)."""
    cfg.check_tp(encoder_tp=encoder.axis_size("tp"), llm_tp=llm.axis_size("tp"))
    cfg.check_cp_comm(cp_comm, llm_tp=llm.axis_size("tp"), llm_cp=llm.axis_size("cp"))


@dataclass(frozen=True)
class _GradSpec(FrozenSpec):
    """What the ranks of one gradient bucket sum: its parameters' count, elements and
    dtypes, and whether any gradient is present (all skip, or all reduce)."""

    params: int
    numel: int
    dtypes: tuple[str, ...]
    has_grad: bool


def _all_reduce_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    params = list(params)
    spec = _GradSpec(
        len(params), sum(p.numel() for p in params),
        tuple(sorted({str(p.dtype) for p in params})), any(p.grad is not None for p in params),
    )  # fmt: skip
    agree("ColocatedMimoModel.sync_gradients", group, spec, device=params[0].device)
    if not spec.has_grad:
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
