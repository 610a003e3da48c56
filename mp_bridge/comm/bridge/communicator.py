"""Colocated bridge: execute a :class:`BridgePlan` with process groups and autograd.

The plan (``bridge_plan.py``) decides who talks to whom; this module only creates the
gather groups it names (the dest CP group comes from the grid) and runs one autograd
Function per direction:

=========  ==========================================  =====================================
direction  forward                                     backward (adjoint)
=========  ==========================================  =====================================
FAN_IN     all-gather along batch in the gather group  [CP all-reduce] then keep own slot
FAN_OUT    keep slot ``dest_dp mod k`` (local narrow)  [CP all-reduce] then all-gather batch
EQUAL      copy                                        [CP all-reduce]
=========  ==========================================  =====================================

Every output is a fresh tensor the caller owns (in-place ops on it are allowed and never
reach the encoder's activation): FAN_IN returns the gather buffer itself (no copy beyond
the collective's; a layout copy only when the batch dim is not dim 0), FAN_OUT copies its
slot (``b_src / k`` rows), EQUAL copies the input (the one copy an identity needs to stop
aliasing).

Why the CP all-reduce: with dest CP > 1 the LLM takes its sequence chunks with
``index_select``, whose adjoint zero-pads, so each CP rank's incoming gradient holds only
its own chunks. Summing over the dest CP group rebuilds the full-sequence gradient before
the direction step (the gradient is cloned first: autograd owns the incoming buffer).

Double backward: FAN_IN and FAN_OUT raise on ``backward(create_graph=True)`` (their
backward collectives run outside autograd); EQUAL is ``copy_to_group``, which supports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mp_bridge.checks.agreement import check_agreement
from mp_bridge.comm.bridge.plan import BridgeDirection, BridgePlan, plan_bridge
from mp_bridge.comm.bridge.ragged import bridge_ragged
from mp_bridge.comm.bridge.route import make_route_group, make_world_group, route_image_rows
from mp_bridge.comm.bridge.route_plan import RouteCache
from mp_bridge.comm.collectives.primitives import (
    all_gather_tensor,
    all_reduce_sum,
    copy_to_group,
    forbid_double_backward,
)
from mp_bridge.comm.sequence.partition import PartitionAdapter
from mp_bridge.grid import MISSING_PG_ERRORS, GridLayout

__all__ = ["ColocatedBridgeCommunicator"]

_DEFAULT_DIM_MAPPING = {"b": 0, "s": 1, "h": 2}


def _check_dim_mapping(dim_mapping: Mapping[str, int] | None) -> dict[str, int]:
    if dim_mapping is None:
        return dict(_DEFAULT_DIM_MAPPING)
    if not isinstance(dim_mapping, Mapping):
        raise TypeError(
            f"dim_mapping must be a dict such as {{'b': 0, 's': 1, 'h': 2}}, "
            f"got {type(dim_mapping).__name__}"
        )
    mapping = dict(dim_mapping)
    unknown = sorted(set(mapping) - {"b", "s", "h"})
    missing = [k for k in ("b", "h") if k not in mapping]
    if unknown or missing:
        raise ValueError(
            f"dim_mapping={mapping} must have keys 'b' and 'h' (and optionally 's'); "
            f"unknown {unknown}, missing {missing}. Use {{'b': 0, 's': 1, 'h': 2}} or, for a "
            f"batch-major flattened (b*s, h) tensor, {{'b': 0, 'h': 1}}"
        )
    values = list(mapping.values())
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values) or sorted(values) != list(
        range(len(values))
    ):
        raise ValueError(
            f"dim_mapping={mapping} must map its keys to the distinct tensor dims "
            f"0..{len(values) - 1} (one key per dim), e.g. {{'b': 0, 's': 1, 'h': 2}}"
        )
    return mapping


def _cp_all_reduce(grad: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the per-CP-rank partial gradients (out of place; identity for no/size-1 group)."""
    return all_reduce_sum(grad, cp_group)


def _slot(x: torch.Tensor, dim: int, slot: int, k: int) -> torch.Tensor:
    size = x.shape[dim] // k
    return x.narrow(dim, slot * size, size)


class _FanIn(torch.autograd.Function):
    """Forward: all-gather ``x`` along the batch dim in the gather group (members in
    concatenation order). Backward: CP all-reduce (if any), then keep this rank's slot."""

    @staticmethod
    def forward(ctx, x, gather_group, cp_group, dim, slot, k):
        ctx.cp_group, ctx.dim, ctx.slot, ctx.k = cp_group, dim, slot, k
        return all_gather_tensor(x, gather_group, dim)

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("ColocatedBridgeCommunicator.communicate (FAN_IN)")
        grad = _cp_all_reduce(grad, ctx.cp_group)
        out = _slot(grad, ctx.dim, ctx.slot, ctx.k).contiguous()
        return out, None, None, None, None, None


class _FanOut(torch.autograd.Function):
    """Forward: keep slot ``dest_dp mod k`` of the batch (no communication). Backward: CP
    all-reduce (if any), then all-gather the slot gradients along batch in the gather group."""

    @staticmethod
    def forward(ctx, x, gather_group, cp_group, dim, slot, k):
        ctx.gather_group, ctx.cp_group, ctx.dim = gather_group, cp_group, dim
        # A copy, not a view: the output must not alias the caller's input.
        return _slot(x, dim, slot, k).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("ColocatedBridgeCommunicator.communicate (FAN_OUT)")
        grad = _cp_all_reduce(grad, ctx.cp_group)
        return all_gather_tensor(grad, ctx.gather_group, ctx.dim), None, None, None, None, None


def _pick_name(ours: str | None, megatrons: str | None, arg: str, default: str) -> str:
    """One module name from our keyword and megatron's spelling of it (they must agree)."""
    if ours is not None and megatrons is not None and ours != megatrons:
        raise ValueError(
            f"{arg}={ours!r} and its megatron spelling {arg.replace('_name', '_module_name')}="
            f"{megatrons!r} disagree; pass one of them"
        )
    name = ours if ours is not None else megatrons
    if name is None:
        return default
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str, got {type(name).__name__}")
    return name


class ColocatedBridgeCommunicator:
    """Move an activation from ``src_grid``'s layout (TP×DP) to ``dest_grid``'s (TP×CP×DP).

    ``communicate(x)``: ``x`` is this rank's src shard ``[b_src, s, h]`` (TP-replicated in
    its src DP replica); returns its dest shard ``[b_dest, s, h]`` (FAN_IN
    ``b_dest = k·b_src``, FAN_OUT ``b_dest = b_src / k``), replicated over dest TP and CP
    (the LLM takes its CP chunks itself). Collectives per call: FAN_IN forward one
    all-gather; FAN_OUT backward one all-gather; plus one all-reduce in backward when dest
    CP > 1; nothing else. See the module docstring for the adjoints.

    Construction is collective over the whole world: every rank (even one outside the
    grids) must build the communicator with the same arguments, in the same order as its
    other group creations. It validates the layouts (``plan_bridge``) and ``dim_mapping``
    before creating any group, then creates the gather and ``route`` groups (the latter
    reuse the CP group when equal) and, when the grids do not cover the whole world, a
    group of all their ranks (``route``'s count check; else the default group is used)
    with the default backend; it owns those and frees them in ``destroy()``. The dest CP
    group (needed when dest CP > 1) belongs to the grid:
    ``dest_grid.get_pg('cp')``, created on the grid with ``create_pg('cp')`` if it lacks
    one (``mp_bridge.models.make_mimo_groups`` builds it with every other group up front).
    Only a pure ``GridLayout``, which holds no groups, makes the communicator create (and
    free) the CP groups itself.

    Args:
        src_grid, dest_grid: megatron-core ``HyperCommGrid``s on the same ranks (or
            :class:`~mp_bridge.grid.GridLayout`s, which hold no groups). Kept as
            ``src_grid`` / ``dest_grid`` (megatron's attribute names).
        src_module_name, dest_module_name: megatron-core's spellings of ``src_name`` /
            ``dest_name`` (same positions as in megatron's constructor, so a call written
            for ``megatron.core.models.mimo.comm.colocated_communicator`` works unchanged).
        dim_mapping: tensor dims of ``'b'``, ``'s'``, ``'h'``; default
            ``{'b': 0, 's': 1, 'h': 2}``. A batch-major flattened ``(b*s, h)`` tensor uses
            ``{'b': 0, 'h': 1}`` (then only ``b*s`` divisible by ``k`` can be checked).
        src_name, dest_name: names used in messages and ``plan.describe()`` (default
            ``'encoder'`` / ``'llm'``).

    Use as a context manager (or call ``destroy()``, idempotent) to free the groups; like
    group creation, ``destroy()`` must run on every rank. Construction ends with one world
    barrier (so every rank's groups are fully connected before any rank uses or frees them).
    """

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
        # Everything below up to the first new_group is local validation (no collective).
        src_name = _pick_name(src_name, src_module_name, "src_name", "encoder")
        dest_name = _pick_name(dest_name, dest_module_name, "dest_name", "llm")
        src = GridLayout.from_grid(src_grid)
        dest = GridLayout.from_grid(dest_grid)
        self._dim_mapping = _check_dim_mapping(dim_mapping)
        self._plan = plan_bridge(src, dest, src_name=src_name, dest_name=dest_name)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ColocatedBridgeCommunicator needs an initialized torch.distributed world; "
                "call torch.distributed.init_process_group first"
            )
        world = dist.get_world_size()
        if src.ranks.stop > world:
            raise ValueError(
                f"the grids cover ranks [{src.ranks.start}, {src.ranks.stop}) but the world "
                f"has {world} ranks; launch at least {src.ranks.stop} ranks"
            )
        self._rank = dist.get_rank()
        self._owned: list[dist.ProcessGroup] = []
        self._gather_group: dist.ProcessGroup | None = None
        self.src_grid, self.dest_grid = src_grid, dest_grid
        self._cp_group: dist.ProcessGroup | None = None
        self._route_group: dist.ProcessGroup | None = None
        self._route_members: tuple[int, ...] = (self._rank,)
        self._world_group: dist.ProcessGroup | None = None
        self._route_cache = RouteCache(maxsize=8)
        self._destroyed = False

        try:
            # EQUAL's gather groups are single ranks: nothing to create.
            gather_groups = self._plan.gather_groups if self._plan.scale > 1 else ()
            if self._plan.cp_size > 1:
                self._cp_group = self._dest_cp_group(dest_grid)
            for members in gather_groups:  # collective: same order on every rank
                pg = dist.new_group(list(members))
                if self._rank in members:
                    self._gather_group = pg
                    self._owned.append(pg)
                    # torch orders a group's ranks ascending; the plan's concatenation order
                    # (by dp coordinate) is ascending too, so slot == group rank.
                    assert dist.get_process_group_ranks(pg) == list(members), members
            self._route_group, self._route_members, owned = make_route_group(
                self._plan, self._rank, self._cp_group
            )
            self._owned += owned
            self._world_group, owned = make_world_group(self._plan, self._rank, world)
            self._owned += owned
        except BaseException:
            self.destroy()  # do not leak the groups created so far
            raise
        # gloo finishes a new group's TCP handshakes asynchronously: a rank that returned
        # from new_group and destroyed the group at once could close a socket its peer is
        # still handshaking on ("connectFullMesh failed: Connection closed by peer").
        # One world barrier after creation makes every group complete before any use.
        dist.barrier()

    def _dest_cp_group(self, dest_grid: Any) -> dist.ProcessGroup | None:
        """This rank's dest CP group (collective when it must be created; see the class doc).

        A ``HyperCommGrid`` that holds a ``'cp'`` group lends it; one that lacks it is asked
        to create it (``create_pg('cp')``: the grid owns it, ``destroy_grid`` frees it); a
        pure ``GridLayout`` holds no groups, so the communicator creates the CP groups
        itself and frees them in ``destroy()``.
        """
        if not hasattr(dest_grid, "get_pg"):
            mine = None
            for members in self._plan.cp_groups:  # collective: same order on every rank
                pg = dist.new_group(list(members))
                if self._rank in members:
                    mine = pg
                    self._owned.append(pg)
            return mine
        try:
            pg = dest_grid.get_pg("cp")
        except MISSING_PG_ERRORS:  # the error type differs by megatron-core version
            pg = dest_grid.create_pg("cp")
        if self._rank in self._plan.src.ranks:
            expected = list(self._plan.cp_group_of(self._rank))
            got = dist.get_process_group_ranks(pg) if pg is not None else None
            if got != expected:
                raise ValueError(
                    f"dest_grid.get_pg('cp') on rank {self._rank} holds ranks {got} but the "
                    f"dest layout {self._plan.dest!r} puts this rank's CP group at "
                    f"{expected}; build the grid's groups with create_pg('cp')"
                )
        return pg

    # ------------------------------------------------------------------ properties
    @property
    def plan(self) -> BridgePlan:
        return self._plan

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
    def gather_group(self) -> dist.ProcessGroup | None:
        """This rank's gather group (``None`` for EQUAL or after ``destroy()``)."""
        return self._gather_group

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """This rank's dest CP group (``None`` when dest CP = 1 or after ``destroy()``)."""
        return self._cp_group

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """A group of every rank of the grids (the default group when they cover the
        world; ``None`` for one rank or after ``destroy()``): ``route``'s count check, and
        :func:`~mp_bridge.comm.check_sample_counts` for a caller's own flow."""
        return self._world_group

    # ------------------------------------------------------------------ execution
    def communicate(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's src shard -> its dest shard (autograd-aware; see class docstring)."""
        if self._destroyed:
            raise RuntimeError("communicate() after destroy(); build a new communicator")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self._rank not in self._plan.src.ranks:
            raise ValueError(
                f"rank {self._rank} is outside the bridged grids {self._plan.src!r}; call "
                f"communicate() only on ranks {list(self._plan.src.ranks)}"
            )
        if x.dim() != len(self._dim_mapping):
            raise ValueError(
                f"x has shape {tuple(x.shape)} ({x.dim()} dims) but dim_mapping="
                f"{self._dim_mapping} describes {len(self._dim_mapping)} dims; pass a "
                f"matching dim_mapping (e.g. {{'b': 0, 'h': 1}} for a flattened (b*s, h) x)"
            )
        dim = self._dim_mapping["b"]
        k = self._plan.scale
        direction = self._plan.direction
        if direction is BridgeDirection.FAN_OUT and x.shape[dim] % k:
            raise ValueError(
                f"x has batch size {x.shape[dim]} (dim {dim} of shape {tuple(x.shape)}) but "
                f"FAN_OUT with scale {k} splits it into {k} equal slots; use a local batch "
                f"divisible by {k}"
            )
        slot = self._plan.slot_of(self._rank)
        check_agreement(  # the group of this call's collective (MP_BRIDGE_CHECK)
            "ColocatedBridgeCommunicator.communicate",
            self._gather_group if k > 1 else self._cp_group,
            {"x.shape": tuple(x.shape), "x.dtype": x.dtype, "x.device": x.device.type},
            device=x.device,
        )
        if direction is BridgeDirection.FAN_IN:
            return _FanIn.apply(x, self._gather_group, self._cp_group, dim, slot, k)
        if direction is BridgeDirection.FAN_OUT:
            return _FanOut.apply(x, self._gather_group, self._cp_group, dim, slot, k)
        # EQUAL: copy forward, CP all-reduce of the gradient backward (Megatron's f).
        # copy_to_group: identity forward, CP all-reduce backward (double-backward safe);
        # the clone is the one copy that stops the output aliasing the input.
        return copy_to_group(x, self._cp_group).clone(memory_format=torch.contiguous_format)

    __call__ = communicate

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
        of samples raises on every rank of its gather group after the header. FAN_OUT has
        no forward collective, so its members (one src replica) must pass equal counts.
        Every backward applies its adjoint Function, so ``backward(create_graph=True)``
        works in every direction. See :mod:`mp_bridge.comm.bridge.ragged`.
        """
        if self._destroyed:
            raise RuntimeError("communicate_ragged() after destroy(); build a new communicator")
        # FAN_IN's own header exchange (always on) already compares samples and row
        # sizes; FAN_OUT and EQUAL have no forward collective to do it.
        if isinstance(x, torch.Tensor) and self._plan.direction is not BridgeDirection.FAN_IN:
            check_agreement(
                "ColocatedBridgeCommunicator.communicate_ragged",
                self._gather_group if self._plan.scale > 1 else self._cp_group,
                {"x.shape[1:]": tuple(x.shape[1:]), "x.dtype": x.dtype, "x.dim()": x.dim()},
                device=x.device,
            )
        return bridge_ragged(
            x,
            tokens_per_sample,
            plan=self._plan,
            rank=self._rank,
            gather_group=self._gather_group,
            cp_group=self._cp_group,
        )

    def route(
        self,
        x: torch.Tensor,
        *,
        tokens_per_sample: torch.Tensor | Sequence[int],
        image_mask: torch.Tensor,
        partition: PartitionAdapter,
        cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Image tokens of this rank's encoder batch -> the image rows of its LLM shard.

        ``x`` ``[T, *rest]``, ``tokens_per_sample``: as in :meth:`communicate_ragged`.
        ``image_mask``: bool ``[B, S]`` of this rank's LLM DP batch (packed: ``[T_llm]``
        with ``cu_seqlens``, one document per sample), the same on every rank of the
        replica; sample ``i``'s ``j``-th ``True`` takes its ``j``-th image token.
        ``partition``: the LLM's adapter. Returns ``[n_local, *rest]``, the rows
        ``partition.shard(full).embeddings`` holds at image positions, in shard order.

        Collectives, forward: one fixed-size (56-byte row) all-gather over every rank of
        the grids checking the per-sample counts (FAN_IN, EQUAL: the only metadata), FAN_OUT
        a second all-gather over its route group of its LLM batches' image-token shard ids
        (the honest price of a count check covering every rank), FAN_IN one
        ``all_to_all_single`` of exactly the missing rows; backward one
        ``all_to_all_single``. Must be called on every rank of the grids: a sample whose
        ``image_mask`` count differs from its ``tokens_per_sample`` entry, or a rank
        passing a different number of samples, raises the same ``ValueError`` on every
        rank (naming the first bad sample). Plans are cached (8 layouts). Bytes, backward
        and errors: see :mod:`mp_bridge.comm.bridge.route`.
        """
        if self._destroyed:
            raise RuntimeError("route() after destroy(); build a new communicator")
        return route_image_rows(
            x,
            tokens_per_sample,
            image_mask,
            partition,
            cu_seqlens=cu_seqlens,
            plan=self._plan,
            rank=self._rank,
            group=self._route_group,
            members=self._route_members,
            world_group=self._world_group,
            cache=self._route_cache,
        )

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Free every process group this communicator created (idempotent, every rank)."""
        if self._destroyed:
            return
        self._destroyed = True
        owned, self._owned = self._owned, []
        for pg in owned:
            dist.destroy_process_group(pg)
        self._gather_group = None
        self._cp_group = None
        self._route_group = None
        self._world_group = None
        self._route_cache.clear()

    def __enter__(self) -> ColocatedBridgeCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = ", destroyed" if self._destroyed else ""
        return f"ColocatedBridgeCommunicator({self._plan!r}{state})"
