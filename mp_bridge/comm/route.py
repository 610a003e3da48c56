"""``route``: each image token from the encoder rank holding it to the LLM shard using it.

One rank's step (the plan is :mod:`mp_bridge.comm.route_plan`):

1. Local validation (``ValueError`` before any collective).
2. Metadata (route group of size > 1): FAN_IN one all-gather of every member's
   per-sample token counts (``8·(1 + n_src)`` bytes each); FAN_OUT one all-gather of the
   counts, the LLM batch's per-sample image counts and the shard id of each of its image
   tokens (padded to ``T``: ``8·(1 + n_src + B + T)`` bytes each); EQUAL none (every
   member holds the same batches). Every rank then checks every sample's image count
   against its token count and raises the same ``ValueError`` naming the first bad one.
3. Forward (FAN_IN only; FAN_OUT/EQUAL ranks hold all their rows already): one
   ``all_to_all_single`` with exact row splits: each rank receives exactly the image rows
   of its shard it does not hold.
4. Backward: one ``all_to_all_single``: each encoder rank receives exactly the gradient
   rows of its tokens it did not consume itself, so every encoder TP replica ends with
   the full gradient; no CP all-reduce. Double backward is refused
   (``forbid_double_backward``): the backward exchange is not the forward's adjoint
   (it fans each gradient out to every encoder TP replica).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .bridge_plan import BridgeDirection, BridgePlan
from .partition import PartitionAdapter
from .primitives import all_gather_tensor, forbid_double_backward, group_size
from .ragged import check_tokens_per_sample
from .route_plan import RankRoute, image_token_shards, plan_route, route_groups, route_needs

__all__ = ["make_route_group", "route_image_rows"]


def make_route_group(plan: BridgePlan, rank: int, cp_group: dist.ProcessGroup | None):
    """``(group, members, owned)``: this rank's route group (collective: every rank of
    the world creates every group of size > 1 in the same order; a route group equal to
    a dest CP group, i.e. dest tp = 1, reuses ``cp_group``). ``owned``: groups created."""
    mine, members_of, owned = None, (rank,), []
    for members in route_groups(plan):
        if len(members) < 2 or members in plan.cp_groups:
            if rank in members:
                mine, members_of = (cp_group if len(members) > 1 else None), members
            continue
        pg = dist.new_group(list(members))
        if rank in members:
            mine, members_of = pg, members
            owned.append(pg)
    return mine, members_of, owned


def _exchange(rows: torch.Tensor, send: Sequence[torch.Tensor], recv: Sequence[int], group):
    """Send ``rows[send[m]]`` to member ``m``; return the received rows, member order."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    payload = torch.cat([rows[s.to(rows.device)] for s in send]) if send else rows[:0]
    dist.all_to_all_single(
        out, payload.contiguous(), list(recv), [len(s) for s in send], group=group
    )
    return out


class _RouteRows(torch.autograd.Function):
    """Forward: own rows plus (if ``exchange``) the rows the plan routes here.
    Backward: one exchange of gradient rows to every holder (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, route: RankRoute, group, exchange: bool):
        ctx.route, ctx.group = route, group
        y = x.new_empty((route.n_local, *x.shape[1:]))
        y[route.keep_y.to(x.device)] = x[route.keep_x.to(x.device)]
        if exchange:
            got = _exchange(x, route.send_x, route.fwd_rows()[1], group)
            if len(got):
                y[torch.cat(route.recv_y).to(x.device)] = got
        return y

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("ColocatedBridgeCommunicator.route")
        route = ctx.route
        grad_x = grad.new_zeros((route.x_rows, *grad.shape[1:]))
        grad_x[route.bwd_keep_x.to(grad.device)] = grad[route.bwd_keep_y.to(grad.device)]
        if group_size(ctx.group) > 1:
            got = _exchange(grad, route.bwd_send_y, route.bwd_rows()[1], ctx.group)
            if len(got):
                grad_x[torch.cat(route.bwd_recv_x).to(grad.device)] = got
        return grad_x, None, None, None


def _mask_counts(mask: torch.Tensor, bounds) -> list[int]:
    if bounds is None:
        return mask.sum(1).tolist()
    c = torch.cat([torch.zeros(1, dtype=torch.long), mask.long().cumsum(0)])
    return [int(c[b] - c[a]) for a, b in zip(bounds[:-1], bounds[1:])]


def _check_inputs(x, image_mask, cu_seqlens, partition, plan: BridgePlan, rank: int):
    if rank not in plan.src.ranks:
        raise ValueError(
            f"rank {rank} is outside the bridged grids {plan.src!r}; call route() only on "
            f"ranks {list(plan.src.ranks)}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be the flat image tokens [T, *rest] (e.g. [T, h]), got {x!r}")
    if not isinstance(image_mask, torch.Tensor) or image_mask.dtype != torch.bool:
        raise TypeError(
            f"image_mask must be a bool tensor ([B, S], or [T] with cu_seqlens), got "
            f"{getattr(image_mask, 'dtype', type(image_mask).__name__)}"
        )
    want = 1 if cu_seqlens is not None else 2
    if image_mask.dim() != want:
        raise ValueError(
            f"image_mask has shape {tuple(image_mask.shape)}; expected "
            + ("[T] for packed input (cu_seqlens given)" if want == 1 else "[B, S] (plain)")
        )
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


def route_image_rows(
    x: torch.Tensor,
    tokens_per_sample: object,
    image_mask: torch.Tensor,
    partition: PartitionAdapter,
    *,
    cu_seqlens=None,
    plan: BridgePlan,
    rank: int,
    group: dist.ProcessGroup | None,
    members: tuple[int, ...],
) -> torch.Tensor:
    """One rank's ``route``; see ``ColocatedBridgeCommunicator.route``."""
    pieces = _check_inputs(x, image_mask, cu_seqlens, partition, plan, rank)
    counts = check_tokens_per_sample(tokens_per_sample, x.shape[0])
    layout = partition.layout(image_mask.shape[-1], cu_seqlens=cu_seqlens)
    mask = image_mask.detach().cpu()
    n_dest = mask.shape[0] if layout.bounds is None else len(layout.bounds) - 1
    k, direction = plan.scale, plan.direction
    fan_in, fan_out = direction is BridgeDirection.FAN_IN, direction is BridgeDirection.FAN_OUT
    if fan_in and n_dest % k:
        raise ValueError(
            f"image_mask holds {n_dest} samples but FAN_IN with scale {k} joins {k} equal "
            f"encoder batches; pass the whole LLM DP batch (a multiple of {k} samples)"
        )
    n_src = n_dest // k if fan_in else n_dest * k if fan_out else n_dest
    shards = image_token_shards(mask, layout)
    mask_counts = _mask_counts(mask, layout.bounds)
    s_dp, d_dp = plan.src.coords(rank)["dp"], plan.dest.coords(rank)["dp"]

    # ---- metadata: every member's counts (and, FAN_OUT, its LLM batch's image tokens)
    header = [len(counts)] + (list(counts) + [-1] * n_src)[:n_src]
    if fan_out:
        header += mask_counts + (shards.tolist() + [-1] * x.shape[0])[: x.shape[0]]
    if len(members) > 1 and direction is not BridgeDirection.EQUAL:
        local = torch.tensor(header, dtype=torch.int64, device=x.device)
        rows = all_gather_tensor(local, group, 0).reshape(len(members), -1).cpu().tolist()
    else:
        rows = [header] * len(members)
    src_counts, dest_counts, dest_shards = {}, {}, {}
    for m, row in zip(members, rows):
        if row[0] != n_src:
            raise ValueError(
                f"rank {m} passed tokens_per_sample with {row[0]} samples, but its encoder DP "
                f"batch has {n_src} ({direction.name}, scale {k}, {n_dest} LLM samples); pass "
                f"one count per sample of the encoder DP batch"
            )
        s, d = plan.src.coords(m)["dp"], plan.dest.coords(m)["dp"]
        src_counts.setdefault(s, tuple(row[1 : 1 + n_src]))
        if fan_out:
            dest_counts.setdefault(d, row[1 + n_src : 1 + n_src + n_dest])
            tail = torch.tensor(row[1 + n_src + n_dest :], dtype=torch.long)
            dest_shards.setdefault(d, tail[: sum(dest_counts[d])])
    if not fan_out:
        dest_counts, dest_shards = {d_dp: mask_counts}, {d_dp: shards}
    _check_counts(src_counts, dest_counts)
    holds, needs = route_needs(
        plan,
        members,
        pieces=pieces,
        src_totals={s: sum(c) for s, c in src_counts.items()},
        dest_shards=dest_shards,
    )
    route = plan_route(members, rank, holds, needs)
    assert route.x_rows == x.shape[0] and s_dp in src_counts, (route, x.shape)
    exchange = fan_in and len(members) > 1
    return _RouteRows.apply(x, route, group, exchange)


def _check_counts(src_counts: dict, dest_counts: dict) -> None:
    """Raise unless the samples' image counts equal their token counts (group order)."""
    src = [c for s in sorted(src_counts) for c in src_counts[s]]
    dest = [c for d in sorted(dest_counts) for c in dest_counts[d]]
    per_dest = len(dest) // max(len(dest_counts), 1)
    for i, (a, b) in enumerate(zip(src, dest)):
        if a != b:
            replica = sorted(dest_counts)[i // per_dest]
            raise ValueError(
                f"sample {i % per_dest} of LLM DP replica {replica} has {b} True entries in "
                f"image_mask but {a} image tokens in tokens_per_sample; the j-th True position "
                f"takes the sample's j-th token, so the counts must match"
            )
