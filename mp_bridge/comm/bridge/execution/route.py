"""``route``: each image token from the encoder rank holding it to the LLM shard using it.

One rank's step (the plan is :mod:`mp_bridge.comm.bridge.plans.route`):

1. Local validation (``ValueError`` before any collective).
2. Metadata, forward. FAN_IN and EQUAL: **one** all-gather over the bridge's world group
   (every rank of the grids) of a fixed-size int64 row per rank,
   ``8·ROW_SIZE = 56`` bytes (:mod:`mp_bridge.comm.bridge.plans.count_rows`): sample numbers,
   token totals and order-sensitive fingerprints of the per-sample counts. Every rank
   checks every sample's image count against its token count, and every replica's
   TP/CP ranks against each other; on a mismatch every rank of the bridge raises the
   same ``ValueError`` naming the first bad sample (the error path adds one
   ``all_gather_object``). FAN_IN needs nothing else (the rows carry each member's token
   total, which places its held range). FAN_OUT: **two** — the world row, then one
   all-gather over the route group of the shard id of each image token of every
   member's LLM batch (padded to the largest LLM batch of the group:
   ``8·max_n_image`` bytes per member; skipped when that is 0). One metadata
   exchange would be the floor; FAN_OUT's second is the price of a check that covers
   every rank (the shard ids cannot be in a fixed-size row, and a size-mismatched
   collective must never run).
3. Forward (FAN_IN only; FAN_OUT/EQUAL ranks hold all their rows already): one
   ``all_to_all_single`` with exact row splits: each rank receives exactly the image rows
   of its shard it does not hold.
4. Backward: one ``all_to_all_single``: each encoder rank receives exactly the gradient
   rows of its tokens it did not consume itself, so every encoder TP replica ends with
   the full gradient; no CP all-reduce. Double backward is refused
   (``forbid_double_backward``): the backward exchange is not the forward's adjoint
   (it fans each gradient out to every encoder TP replica).

The route's rows are a :class:`~mp_bridge.comm.bridge.plans.row_move.RowMove`
(:meth:`RankRoute.move`), run by
:func:`~mp_bridge.comm.bridge.execution.row_move.one_way_move`.

The plan depends only on each member's token total, the shard ids of the LLM batches and
the SP pieces: the communicator keeps the last 8 plans (:class:`PlanCache`), so steps
with a repeated layout skip planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.comm.bridge.execution.row_move import one_way_move
from mp_bridge.comm.bridge.execution.sample_counts import check_sample_counts
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.comm.bridge.plans.route import (
    RankRoute,
    image_token_shards,
    plan_route,
    route_needs,
)
from mp_bridge.comm.bridge.plans.token_counts import check_tokens_per_sample
from mp_bridge.comm.collectives.primitives import all_gather_tensor
from mp_bridge.comm.sequence.padding import PaddedLayout
from mp_bridge.comm.sequence.partition import PartitionAdapter
from mp_bridge.comm.sequence.samples import sample_sums

__all__ = ["RouteCall", "apply_route", "parse_route", "parse_route_trusted", "run_route"]


@dataclass(frozen=True)
class RouteCall:
    """One rank's parsed ``route`` arguments (local validation done, no collective yet).

    ``counts``: ``tokens_per_sample`` as ints; ``mask``: ``image_mask`` on the CPU;
    ``layout``: the LLM batch's parsed layout; ``pieces``: SP pieces per CP shard."""

    x: torch.Tensor
    counts: tuple[int, ...]
    mask: torch.Tensor
    layout: PaddedLayout
    pieces: int


def _check_partition(partition: object, plan: BridgePlan, rank: int) -> int:
    if not isinstance(partition, PartitionAdapter):
        raise TypeError(f"partition must be a PartitionAdapter, got {type(partition).__name__}")
    d = plan.dest.coords(rank)
    tp = plan.dest.axis_size("tp")
    sp = partition.sequence_parallel and partition.tp_size > 1
    ok = partition.cp_size == plan.cp_size and partition.cp_rank == d.get("cp", 0)
    if sp:
        ok = ok and partition.tp_size == tp and partition.tp_rank == d["tp"]
    if not ok:
        raise ValueError(
            f"{partition!r} (cp rank {partition.cp_rank}, tp rank {partition.tp_rank}) does not "
            f"match rank {rank}'s LLM coords {d} in {plan.dest!r}; build the partition with the "
            f"LLM grid's CP group (and its TP group with sequence_parallel=True)"
        )
    return tp if sp else 1


def parse_route(
    x: object,
    tokens_per_sample: object,
    image_mask: object,
    partition: object,
    *,
    plan: BridgePlan,
    rank: int,
    **options: object,
) -> RouteCall:
    """:func:`parse_route_trusted` (``options``: its ``cu_seqlens``, ``layout``,
    ``source_rows``) behind the membership check, for a caller that plans and runs
    ``route`` itself (``parse_route`` then :func:`run_route`): ``ValueError`` unless
    ``rank`` is one of the bridged ranks. The communicator's entry guard checks that once
    and calls :func:`parse_route_trusted` directly."""
    plan.check_member(rank, "route()")
    return parse_route_trusted(
        x, tokens_per_sample, image_mask, partition, plan=plan, rank=rank, **options
    )


def parse_route_trusted(
    x: object,
    tokens_per_sample: object,
    image_mask: object,
    partition: object,
    *,
    cu_seqlens: object = None,
    layout: PaddedLayout | None = None,
    plan: BridgePlan,
    rank: int,
    source_rows: int | None = None,
) -> RouteCall:
    """Validate one rank's ``route`` arguments (``ValueError``/``TypeError``, no collective).

    ``layout`` (``ShardedBatch.layout``) is used as is; without it the layout is parsed
    here from ``image_mask``'s length and ``cu_seqlens``. ``source_rows``: with a balance
    plan, the encoder DP batch's image tokens before balancing (``tokens_per_sample`` sums
    to it, not to ``x``'s rows). ``rank`` is trusted to be one of the bridged ranks."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be the flat image tokens [T, *rest] (e.g. [T, h]), got {x!r}")
    if not isinstance(image_mask, torch.Tensor) or image_mask.dtype != torch.bool:
        raise TypeError(
            f"image_mask must be a bool tensor ([B, S], or [T] with cu_seqlens), got "
            f"{getattr(image_mask, 'dtype', type(image_mask).__name__)}"
        )
    pieces = _check_partition(partition, plan, rank)
    if layout is not None:
        if not isinstance(layout, PaddedLayout):
            raise TypeError(
                f"layout must be a PaddedLayout (ShardedBatch.layout) or None, got "
                f"{type(layout).__name__}"
            )
        if cu_seqlens is not None:
            raise ValueError("pass cu_seqlens or layout (ShardedBatch.layout), not both")
        if (layout.cp, layout.pieces) != (partition.cp_size, pieces):
            raise ValueError(
                f"layout was cut for cp={layout.cp}, {layout.pieces} SP pieces but {partition!r} "
                f"cuts for cp={partition.cp_size}, {pieces}; pass the layout this partition built"
            )
    packed = (layout.bounds is not None) if layout is not None else cu_seqlens is not None
    want = 1 if packed else 2
    if image_mask.dim() != want:
        raise ValueError(
            f"image_mask has shape {tuple(image_mask.shape)}; expected "
            + ("[T] for packed input (cu_seqlens given)" if packed else "[B, S] (plain)")
        )
    if layout is None:
        layout = partition.layout(image_mask.shape[-1], cu_seqlens=cu_seqlens)
    elif layout.seq_len != image_mask.shape[-1]:
        raise ValueError(
            f"layout describes {layout.seq_len} tokens but image_mask has shape "
            f"{tuple(image_mask.shape)}; pass the layout of this batch"
        )
    try:
        counts = check_tokens_per_sample(
            tokens_per_sample, x.shape[0] if source_rows is None else source_rows
        )
    except ValueError as error:
        if source_rows is None:
            raise
        raise ValueError(
            f"{error} (with balance=: the {source_rows} image tokens this encoder DP replica "
            f"held before balancing; pass its pre-balance tokens_per_sample)"
        ) from None
    mask = image_mask.detach().cpu()
    n_dest = mask.shape[0] if layout.bounds is None else len(layout.bounds) - 1
    k = plan.scale
    if plan.direction is BridgeDirection.FAN_IN and n_dest % k:
        raise ValueError(
            f"image_mask holds {n_dest} samples but FAN_IN with scale {k} joins {k} equal "
            f"encoder batches; pass the whole LLM DP batch (a multiple of {k} samples)"
        )
    return RouteCall(x, counts, mask, layout, pieces)


def run_route(
    call: RouteCall,
    *,
    plan: BridgePlan,
    rank: int,
    group: dist.ProcessGroup | None,
    members: tuple[int, ...],
    world_group: dist.ProcessGroup | None,
    cache: PlanCache | None = None,
) -> torch.Tensor:
    """The collectives of one rank's ``route`` on parsed arguments (module docstring)."""
    x, layout, mask, pieces = call.x, call.layout, call.mask, call.pieces
    fan_in = plan.direction is BridgeDirection.FAN_IN
    fan_out = plan.direction is BridgeDirection.FAN_OUT
    shards = image_token_shards(mask, layout)

    # ---- metadata 1 (every rank of the grids, fixed size): the count check
    rows = check_sample_counts(
        plan,
        rank,
        world_group,
        encoder_counts=call.counts,
        llm_counts=sample_sums(mask, layout).tolist(),
        device=x.device,
    )
    by_rank = {r.rank: r for r in rows}
    src_totals = {plan.src.coords(m)["dp"]: by_rank[m].encoder_tokens for m in members}
    # ---- metadata 2 (FAN_OUT, route group): every member's LLM batch's shard ids
    width = max(by_rank[m].llm_tokens for m in members)  # the same on every member
    if fan_out and len(members) > 1 and width > 0:
        local = torch.full((width,), -1, dtype=torch.int64)
        local[: len(shards)] = shards
        got = all_gather_tensor(local.to(x.device), group, 0).reshape(len(members), -1).cpu()
        dest_shards = {}
        for m, row in zip(members, got):
            dest_shards.setdefault(plan.dest.coords(m)["dp"], row[: by_rank[m].llm_tokens])
    elif fan_out:  # one member, or no image token in any member's LLM batch
        dest_shards = {plan.dest.coords(m)["dp"]: shards[:0] for m in members}
        dest_shards[plan.dest.coords(rank)["dp"]] = shards
    else:
        dest_shards = {plan.dest.coords(rank)["dp"]: shards}
    key = (
        pieces,
        tuple(sorted(src_totals.items())),
        tuple((d, s.numpy().tobytes()) for d, s in sorted(dest_shards.items())),
    )

    def make() -> RankRoute:
        holds, needs = route_needs(
            plan, members, pieces=pieces, src_totals=src_totals, dest_shards=dest_shards
        )
        return plan_route(members, rank, holds, needs)

    route = make() if cache is None else cache.get(key, make)
    return apply_route(x, route, group, exchange=fan_in and len(members) > 1)


def apply_route(x: torch.Tensor, route: RankRoute, group, *, exchange: bool) -> torch.Tensor:
    """Run one rank's planned ``route`` over ``group`` (the members' group, in order):
    ``[route.x_rows, *rest] -> [route.n_local, *rest]``; ``exchange=False`` when every
    row it needs is held (only the backward exchanges then)."""
    assert route.x_rows == x.shape[0], (route, x.shape)
    return one_way_move(
        x, route.move(exchange=exchange), group, where="ColocatedBridgeCommunicator.route",
        why="its backward fans each gradient out",
    )  # fmt: skip
