"""``ColocatedBridgeCommunicator``: execute a :class:`BridgePlan` with process groups.

The pure plans (:mod:`mp_bridge.comm.bridge.plans`) decide who talks to whom; the groups
are made by :func:`~.bridge_groups.make_bridge_groups`; each call runs one of three
executions: ``communicate`` (dense, ``dense.py``), ``communicate_ragged`` (``ragged.py``)
and ``route`` (``route.py``).

Every public call passes **one** entry guard at its top (:meth:`_enter`: not destroyed,
this rank inside the grids; nothing later checks either again), its local validation
(before any collective), then **one** agreement: ``communicate``, ragged FAN_OUT/EQUAL
and ``route`` ``agree`` on a :class:`RowsSpec`/:class:`RouteSpec`; ragged FAN_IN on its
fixed-size header all-gather (samples, tokens, row size, a code of row shape and dtype),
a pipelined LLM on its own header: the token exchange trusts them. ``route``'s count rows
then carry data its plan needs (every replica's token totals), not a second verdict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.checks import agree, agreed, check_tensor
from mp_bridge.comm.bridge.execution.balanced_route import check_balance, run_balanced_route
from mp_bridge.comm.bridge.execution.bridge_groups import BridgeGroups, make_bridge_groups
from mp_bridge.comm.bridge.execution.call_specs import (
    CommunicatorSpec,
    RouteSpec,
    RowsSpec,
    layout_key,
    plan_code,
)
from mp_bridge.comm.bridge.execution.dense import bridge_dense, check_dim_mapping
from mp_bridge.comm.bridge.execution.names import bridge_names
from mp_bridge.comm.bridge.execution.ragged import bridge_ragged
from mp_bridge.comm.bridge.execution.route import parse_route_trusted, run_route
from mp_bridge.comm.bridge.execution.stage import deliver_rows, ragged_dest_counts
from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan, plan_bridge
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.comm.bridge.plans.stage import StageDelivery, plan_stage_delivery
from mp_bridge.comm.bridge.plans.token_counts import check_tokens_per_sample
from mp_bridge.comm.sequence.padding import PaddedLayout
from mp_bridge.comm.sequence.partition import PartitionAdapter
from mp_bridge.grid import GridLayout

__all__ = ["ColocatedBridgeCommunicator"]


class ColocatedBridgeCommunicator:
    """Move an activation from ``src_grid``'s layout (TP×DP) to ``dest_grid``'s (TP×CP×DP).

    ``communicate(x)``: ``x`` is this rank's src shard ``[b_src, s, h]`` (TP-replicated in
    its src DP replica); returns its dest shard ``[b_dest, s, h]`` (FAN_IN
    ``b_dest = k·b_src``, FAN_OUT ``b_dest = b_src / k``), replicated over dest TP and CP
    (the LLM takes its CP chunks itself). Collectives per call: FAN_IN forward one
    all-gather; FAN_OUT backward one all-gather; plus one all-reduce in backward when dest
    CP > 1; nothing else. Adjoints: :mod:`mp_bridge.comm.bridge.execution.dense`.

    Construction is collective over the whole world: every rank (even one outside the
    grids) builds the communicator with the same arguments, in the same order as its
    other group creations. It validates the layouts (``plan_bridge``) and ``dim_mapping``
    and agrees on them over the world (:class:`CommunicatorSpec`) before creating any group,
    then makes the gather groups, the dest CP group and the world group
    (:mod:`~mp_bridge.comm.bridge.execution.bridge_groups`, which says who owns which), and
    ends with one world barrier. The route groups are made on the first ``route`` (every rank of
    the grids calls it) or by ``prepare_route()``, which a rank outside the grids must call
    at the same point: a user who never routes pays no group for it.

    Args:
        src_grid, dest_grid: megatron-core ``HyperCommGrid``s on the same ranks (or
            :class:`~mp_bridge.grid.GridLayout`s, which hold no groups).
        src_module_name, dest_module_name: names used in messages and
            ``plan.describe()`` (default ``'encoder'`` / ``'llm'``); megatron-core's
            keywords, in megatron's positions, so a call written for
            ``megatron.core.models.mimo.comm.colocated_communicator`` works unchanged.
        dim_mapping: tensor dims of ``'b'``, ``'s'``, ``'h'``; default
            ``{'b': 0, 's': 1, 'h': 2}``. A batch-major flattened ``(b*s, h)`` tensor uses
            ``{'b': 0, 'h': 1}`` (then only ``b*s`` divisible by ``k`` can be checked).
        src_name, dest_name: deprecated spellings of ``src_module_name`` /
            ``dest_module_name`` (``DeprecationWarning``).

    LLM PP > 1 (a ``pp`` axis in ``dest_grid``): only the LLM's first stage consumes
    encoder rows (:mod:`mp_bridge.comm.bridge.execution.stage`): ``communicate`` and
    ``communicate_ragged`` return the first-stage rank's dest batch and ``[0, ...]`` on a
    later stage, with one exact-bytes ``all_to_all_single`` over the world group each way
    (no gather group is made); ``route`` sends straight to the first stage's CP/SP shard.

    Use as a context manager (or call ``destroy()``, idempotent, on every rank) to free
    the groups it made.
    """

    @agreed("mp_bridge.comm.ColocatedBridgeCommunicator.__init__")
    def __init__(
        self,
        src_grid: Any,
        dest_grid: Any,
        src_module_name: str | None = None,
        dest_module_name: str | None = None,
        dim_mapping: Mapping[str, int] | None = None,
        *,
        src_name: str | None = None,
        dest_name: str | None = None,
    ) -> None:
        # Everything up to make_bridge_groups is local validation (no collective).
        src_name, dest_name = bridge_names(src_module_name, dest_module_name, src_name, dest_name)
        src, dest = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
        self._dim_mapping = check_dim_mapping(dim_mapping)
        # pipeline=True: with LLM PP > 1 this communicator delivers to the first stage only.
        self._plan = plan_bridge(src, dest, src_name=src_name, dest_name=dest_name, pipeline=True)
        self._stage = plan_stage_delivery(self._plan) if self._plan.pp_size > 1 else None
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ColocatedBridgeCommunicator needs an initialized torch.distributed world; "
                "call torch.distributed.init_process_group first"
            )
        self._world = dist.get_world_size()
        if src.ranks.stop > self._world:
            raise ValueError(
                f"the grids cover ranks [{src.ranks.start}, {src.ranks.stop}) but the world "
                f"has {self._world} ranks; launch at least {src.ranks.stop} ranks"
            )
        self._rank = dist.get_rank()
        self.src_grid, self.dest_grid = src_grid, dest_grid
        self._route_cache = PlanCache(maxsize=8)
        self._destroyed = False
        spec = CommunicatorSpec(
            layout_key(src), layout_key(dest), tuple(sorted(self._dim_mapping.items()))
        )
        agree("ColocatedBridgeCommunicator.__init__", dist.group.WORLD, spec)
        self._groups: BridgeGroups = make_bridge_groups(
            self._plan, self._rank, self._world, parts=("dense", "world"), dest_grid=dest_grid
        )

    # ------------------------------------------------------------------ properties
    @property
    def plan(self) -> BridgePlan:
        return self._plan

    @property
    def stage_delivery(self) -> StageDelivery | None:
        """The first-stage delivery plan (LLM PP > 1), else ``None``."""
        return self._stage

    @property
    def direction(self) -> BridgeDirection:
        return self._plan.direction

    @property
    def scale(self) -> int:
        return self._plan.scale

    @property
    def dim_mapping(self) -> dict[str, int]:
        return dict(self._dim_mapping)

    @property
    def groups(self) -> BridgeGroups:
        """This rank's :class:`~mp_bridge.comm.bridge.execution.bridge_groups.BridgeGroups`."""
        return self._groups

    @property
    def gather_group(self) -> dist.ProcessGroup | None:
        """This rank's gather group (``None`` for EQUAL or after ``destroy()``)."""
        return self._groups.gather

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's dest CP group (``None`` when dest CP = 1 or after ``destroy()``)."""
        return self._groups.cp

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """A group of every rank of the grids (the default group when they cover the
        world; ``None`` for one rank or after ``destroy()``): ``route``'s count check, and
        :func:`~mp_bridge.comm.check_sample_counts` for a caller's own flow."""
        return self._groups.world

    # ------------------------------------------------------------------ entry guard
    def _enter(self, call: str) -> None:
        """The one entry guard of every public call, run once at its top: not destroyed,
        and this rank inside the grids (the call's only membership check)."""
        if self._destroyed:
            raise RuntimeError(f"{call}() after destroy(); build a new communicator")
        self._plan.check_member(self._rank, f"{call}()")

    def _agree(self, call: str, spec: RowsSpec, group: Any) -> None:
        """The call's one agreement: ``spec`` (parsed by its local validation) compared
        across ``group`` before its first collective."""
        agree(f"ColocatedBridgeCommunicator.{call}", group, spec, device=spec.device)

    def prepare_route(self) -> None:
        """Make the route groups now (collective over the world; idempotent). ``route``
        calls it; a rank outside the grids calls it where the others first route."""
        if self._destroyed:
            raise RuntimeError("prepare_route() after destroy(); build a new communicator")
        self._make_route_groups()

    def _make_route_groups(self) -> None:
        make_bridge_groups(self._plan, self._rank, self._world, parts=("route",), into=self._groups)

    # ------------------------------------------------------------------ execution
    @agreed("mp_bridge.comm.ColocatedBridgeCommunicator.communicate")
    def communicate(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's src shard -> its dest shard (autograd-aware; see class docstring)."""
        self._enter("communicate")
        check_tensor("x", x)
        if x.dim() != len(self._dim_mapping):
            raise ValueError(
                f"x has shape {tuple(x.shape)} ({x.dim()} dims) but dim_mapping="
                f"{self._dim_mapping} describes {len(self._dim_mapping)} dims; pass a "
                f"matching dim_mapping (e.g. {{'b': 0, 'h': 1}} for a flattened (b*s, h) x)"
            )
        dim, k, direction = self._dim_mapping["b"], self._plan.scale, self._plan.direction
        if direction is BridgeDirection.FAN_OUT and x.shape[dim] % k:
            raise ValueError(
                f"x has batch size {x.shape[dim]} (dim {dim} of shape {tuple(x.shape)}) but "
                f"FAN_OUT with scale {k} splits it into {k} equal slots; use a local batch "
                f"divisible by {k}"
            )
        groups = self._groups
        spec = RowsSpec(tuple(x.shape), x.dtype, x.device.type)
        if self._stage is not None:  # every rank's batch: one exchange over the world
            self._agree("communicate", spec, groups.world)
            move = self._stage.row_move(self._rank, [1] * x.shape[dim], [1] * (
                x.shape[dim] // len(self._stage.src_pieces(self._rank))
                * len(self._stage.dest_pieces(self._rank))))  # fmt: skip
            y = deliver_rows(x.movedim(dim, 0), move, group=groups.world, cp_group=groups.cp)
            return y.movedim(0, dim)
        self._agree("communicate", spec, groups.gather if k > 1 else groups.cp)
        return bridge_dense(
            x,
            direction=direction,
            dim=dim,
            slot=self._plan.slot_of(self._rank),
            k=k,
            gather_group=groups.gather,
            cp_group=groups.cp,
        )

    __call__ = communicate

    @agreed("mp_bridge.comm.ColocatedBridgeCommunicator.communicate_ragged")
    def communicate_ragged(
        self, x: torch.Tensor, tokens_per_sample: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ragged tokens of this rank's encoder batch -> those of its LLM batch.

        ``x`` ``[T, *rest]``: the sample-major tokens of this rank's src DP batch
        (TP-replicated in its replica); ``tokens_per_sample``: 1-D integer tensor or int
        sequence, one count >= 0 per sample, summing to ``T``. Every member of a gather
        group passes the same number of samples; token counts differ freely.

        Returns ``(y, dest_tokens_per_sample)``: ``y`` ``[T_dest, *rest]``, the tokens of
        this rank's dest DP batch in sample order (FAN_IN: the members' tokens in slot
        order; FAN_OUT: this rank's slot of ``n / k`` samples; EQUAL: a copy of ``x``),
        never aliasing ``x``; ``dest_tokens_per_sample`` a CPU int64 tensor of its counts.

        Collectives: FAN_IN forward one fixed-size int64 header all-gather plus one
        ``all_to_all_single`` carrying the counts and exactly the other members' tokens;
        FAN_OUT backward one ``all_to_all_single`` of exactly the other slots' gradients;
        plus one all-reduce over dest CP in backward when dest CP > 1. Local validation
        (``ValueError``) runs before any collective; a member passing a different number
        of samples raises on every rank of its gather group after the header (FAN_IN's
        header is its agreement check; FAN_OUT and EQUAL compare the row shape and dtype
        in the entry guard). Every backward applies its adjoint Function, so
        ``backward(create_graph=True)`` works in every direction. See
        :mod:`mp_bridge.comm.bridge.execution.ragged`.
        """
        self._enter("communicate_ragged")
        check_tensor("x", x)
        if x.dim() < 1:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; pass the flat tokens [T, *rest] (e.g. [T, h])"
            )
        counts = check_tokens_per_sample(tokens_per_sample, x.shape[0])
        groups = self._groups
        if self._stage is not None:
            return self._ragged_to_stage(x, counts)
        if self._plan.direction is not BridgeDirection.FAN_IN:  # FAN_IN: the header agrees
            spec = RowsSpec(tuple(x.shape[1:]), x.dtype, x.device.type)
            group = groups.gather if self._plan.scale > 1 else groups.cp
            self._agree("communicate_ragged", spec, group)
        return bridge_ragged(
            x,
            counts,
            plan=self._plan,
            rank=self._rank,
            gather_group=groups.gather,
            cp_group=groups.cp,
        )

    def _ragged_to_stage(
        self, x: torch.Tensor, counts: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``communicate_ragged`` with LLM PP > 1 (:mod:`~.stage`); its header over the
        world group is the call's agreement."""
        world, ranks = self._groups.world, self._plan.src.ranks
        dest = ragged_dest_counts(x, counts, self._stage, rank=self._rank, group=world,
                                  ranks=ranks)  # fmt: skip
        move = self._stage.row_move(self._rank, counts, dest)
        y = deliver_rows(x, move, group=world, cp_group=self._groups.cp)
        return y, torch.tensor(dest, dtype=torch.int64)

    @agreed("mp_bridge.comm.ColocatedBridgeCommunicator.route")
    def route(
        self,
        x: torch.Tensor,
        *,
        tokens_per_sample: torch.Tensor | Sequence[int],
        image_mask: torch.Tensor,
        partition: PartitionAdapter,
        cu_seqlens: Sequence[int] | torch.Tensor | None = None,
        layout: PaddedLayout | None = None,
        balance: BalancePlan | None = None,
    ) -> torch.Tensor:
        """Image tokens of this rank's encoder batch -> the image rows of its LLM shard.

        ``x`` ``[T, *rest]``, ``tokens_per_sample``: as in :meth:`communicate_ragged`.
        ``image_mask``: bool ``[B, S]`` of this rank's LLM DP batch (packed: ``[T_llm]``
        with ``cu_seqlens``, one document per sample), the same on every rank of the
        replica; sample ``i``'s ``j``-th ``True`` takes its ``j``-th image token.
        ``partition``: the LLM's adapter. ``layout``: the parsed layout
        ``partition.shard`` already built (``ShardedBatch.layout``), so it is not parsed
        again; it replaces ``cu_seqlens``. Returns ``[n_local, *rest]``, the rows
        ``partition.shard(full).embeddings`` holds at image positions, in shard order.

        Collectives, forward: the route groups on the first call
        (:meth:`prepare_route`); one fixed-size (56-byte row) all-gather over every rank
        of the grids checking the per-sample counts (FAN_IN, EQUAL: the only metadata),
        FAN_OUT a second all-gather over its route group of its LLM batches' image-token
        shard ids, FAN_IN one ``all_to_all_single`` of exactly the missing rows; backward
        one ``all_to_all_single``. Must be called on every rank of the grids: a sample
        whose ``image_mask`` count differs from its ``tokens_per_sample`` entry, or a rank
        passing a different number of samples, raises the same ``ValueError`` on every
        rank (naming the first bad sample). Plans are cached (8 layouts). Bytes, backward
        and errors: see :mod:`mp_bridge.comm.bridge.execution.route`.

        ``balance``: the :class:`BalancePlan` of ``ImageBalancer.balance`` (the same on
        every rank). ``x`` then holds the encoded rows of the images this rank's replica
        encoded (``balance.tokens_after(replica)``) and ``tokens_per_sample`` stays its
        encoder DP batch's pre-balance counts (the count check runs on them). Each row goes
        straight from its encoder to its consumers over every rank of the grids, no return
        trip to its source replica: :mod:`mp_bridge.comm.bridge.execution.balanced_route`. A plan
        that moves no image is the plain route.
        """
        self._enter("route")
        self._make_route_groups()  # collective: before any local validation can raise
        source_rows = None
        if balance is not None:
            source_rows = check_balance(balance, x, self._plan, self._rank)
        call = parse_route_trusted(
            x, tokens_per_sample, image_mask, partition, cu_seqlens=cu_seqlens, layout=layout,
            plan=self._plan, rank=self._rank, source_rows=source_rows,
        )  # fmt: skip
        groups = self._groups
        spec = RouteSpec(tuple(x.shape[1:]), x.dtype, x.device.type, plan_code(balance))
        self._agree("route", spec, groups.world)
        if balance is not None and balance.moved_images:
            return run_balanced_route(
                call, balance, plan=self._plan, rank=self._rank, world_group=groups.world,
                cache=self._route_cache,
            )  # fmt: skip
        return run_route(
            call,
            plan=self._plan,
            rank=self._rank,
            group=groups.route,
            members=groups.route_members,
            world_group=groups.world,
            cache=self._route_cache,
        )

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Free every process group this communicator made (idempotent, every rank)."""
        if self._destroyed:
            return
        self._destroyed = True
        self._groups.release()
        self._route_cache.clear()

    def __enter__(self) -> ColocatedBridgeCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = ", destroyed" if self._destroyed else ""
        return f"ColocatedBridgeCommunicator({self._plan!r}{state})"
