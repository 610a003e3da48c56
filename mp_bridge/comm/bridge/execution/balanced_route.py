"""``route(..., balance=plan)``: encoded rows of balanced images straight to their shards.

After :class:`~mp_bridge.comm.bridge.execution.balancer.ImageBalancer` moved whole images between
encoder DP replicas, an encoder rank holds the rows of the images it encoded
(``plan.tokens_after(replica)``), not its own samples' rows. This step sends each
encoded row from that rank straight to the LLM CP/SP shard(s) consuming it (first stage
only when the LLM is pipelined), without first returning it to its source replica.

Tokens are named by their **global** index ``g``: every sample of the global batch in
order, image tokens sample-major (encoder DP replica ``d``'s samples are the ``d``-th
contiguous block, and so are LLM DP replica ``l``'s: both orders are the same ``g``).
Replica ``e`` holds a union of image ranges of ``g``, ascending (the balance plan delivers
kept and received images in (source replica, source index) order, which is ``g`` order);
every TP rank of ``e`` holds the same ranges. Because an image may be encoded outside the
LLM DP replica that consumes it, the route group is **every rank of the grids** (the
bridge's world group). :func:`~mp_bridge.comm.bridge.plans.route.plan_route`
makes the plan from the held
ranges and each shard's needed ``g`` with the usual choices (receiver ``q`` takes ``g``
from holder ``p(q) mod |holders|``; backward every holder gets every gradient, so the TP
peers of an encoding replica end equal).

Collectives, forward: the count check (:func:`~.sample_counts.check_sample_counts`) over the world
group on the **pre-balance** ``tokens_per_sample`` (fixed 56-byte row); one all-gather over
the world group of every rank's LLM batch's image-token shard ids (``8·max_n_image``
bytes per rank, skipped when no rank has an image token); one ``all_to_all_single`` of
exactly the rows each shard lacks. Backward: one ``all_to_all_single`` of exactly the
gradient rows each holder did not consume. A plan that moves no image takes the ordinary
``route`` (its rows are in source order), so balancing a balanced batch costs nothing here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm.bridge.execution.route import RouteCall, apply_route
from mp_bridge.comm.bridge.execution.sample_counts import check_sample_counts
from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.comm.bridge.plans.route import (
    RankRoute,
    image_token_shards,
    plan_route,
)
from mp_bridge.comm.collectives.primitives import all_gather_tensor, group_size
from mp_bridge.comm.sequence.samples import sample_sums

__all__ = ["balanced_holds", "balanced_needs", "check_balance", "run_balanced_route"]


def check_balance(balance: object, x: torch.Tensor, plan: BridgePlan, rank: int) -> int:
    """Local checks of ``balance`` against this rank's ``x`` (no collective); returns this
    replica's image tokens before balancing (what ``tokens_per_sample`` sums to)."""
    if not isinstance(balance, BalancePlan):
        raise TypeError(
            f"balance must be the BalancePlan ImageBalancer.balance returned (or None), got "
            f"{type(balance).__name__}"
        )
    dp = plan.src.axis_size("dp")
    if balance.replicas != dp:
        raise ValueError(
            f"balance plans {balance.replicas} encoder DP replicas but the encoder grid has "
            f"dp={dp}; balance over the encoder DP group of this bridge's encoder grid"
        )
    e = plan.src.coords(rank)["dp"]
    after = sum(balance.tokens_after(e))
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or after != x.shape[0]:
        raise ValueError(
            f"balance gives encoder DP replica {e} {after} image tokens after balancing but x "
            f"has shape {tuple(getattr(x, 'shape', ()))}; pass the encoded rows of the "
            f"balanced images (ImageBalancer.balance's y, encoded)"
        )
    return sum(balance.tokens[e])


def balanced_holds(plan: BridgePlan, members, balance: BalancePlan) -> list[list[tuple[int, int]]]:
    """Each member's held ``g`` ranges (ascending, adjacent images merged)."""
    starts, total = [], 0  # starts[d][j]: g of replica d's image j
    for ts in balance.tokens:
        row = []
        for t in ts:
            row.append(total)
            total += t
        starts.append(row)
    per_replica: list[list[tuple[int, int]]] = [[] for _ in range(balance.replicas)]
    for move in balance.moves():  # (source replica, source index) order: ascending g
        a = starts[move.src][move.src_index]
        held = per_replica[move.dest]
        if held and held[-1][1] == a:
            held[-1] = (held[-1][0], a + move.tokens)
        else:
            held.append((a, a + move.tokens))
    return [per_replica[plan.src.coords(m)["dp"]] for m in members]


def balanced_needs(
    plan: BridgePlan, members, *, pieces: int, dest_shards: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """Each member's needed global ``g`` (ascending; none off the LLM's first stage)."""
    dest_start, total = {}, 0
    for d in sorted(dest_shards):
        dest_start[d], total = total, total + len(dest_shards[d])
    needs = []
    for m in members:
        if not plan.consumes(m):
            needs.append(torch.zeros(0, dtype=torch.long))
            continue
        d = plan.dest.coords(m)
        shard = d.get("cp", 0) * pieces + (d["tp"] if pieces > 1 else 0)
        needs.append(dest_start[d["dp"]] + torch.nonzero(dest_shards[d["dp"]] == shard).reshape(-1))
    return needs


def run_balanced_route(
    call: RouteCall,
    balance: BalancePlan,
    *,
    plan: BridgePlan,
    rank: int,
    world_group: dist.ProcessGroup | None,
    cache: PlanCache | None = None,
) -> torch.Tensor:
    """The collectives of one rank's balanced ``route`` (module docstring)."""
    x, layout, mask, pieces = call.x, call.layout, call.mask, call.pieces
    shards = image_token_shards(mask, layout)
    rows = check_sample_counts(
        plan, rank, world_group, encoder_counts=call.counts,
        llm_counts=sample_sums(mask, layout).tolist(), device=x.device,
    )  # fmt: skip
    members = tuple(r.rank for r in rows)  # the world group, group order
    by_rank = {r.rank: r for r in rows}
    width = max(r.llm_tokens for r in rows)
    dest_shards: dict[int, torch.Tensor] = {}
    if group_size(world_group) > 1 and width > 0:
        local = torch.full((width,), -1, dtype=torch.int64)
        local[: len(shards)] = shards
        got = all_gather_tensor(local.to(x.device), world_group, 0).reshape(len(members), -1)
        for m, row in zip(members, got.cpu()):
            dest_shards.setdefault(plan.dest.coords(m)["dp"], row[: by_rank[m].llm_tokens])
    else:
        for m in members:
            dest_shards.setdefault(plan.dest.coords(m)["dp"], shards[:0])
        dest_shards[plan.dest.coords(rank)["dp"]] = shards
    key = (
        "balanced",
        pieces,
        balance.tokens,
        balance.dest,
        tuple((d, s.numpy().tobytes()) for d, s in sorted(dest_shards.items())),
    )

    def make() -> RankRoute:
        holds = balanced_holds(plan, members, balance)
        needs = balanced_needs(plan, members, pieces=pieces, dest_shards=dest_shards)
        return plan_route(members, rank, holds, needs)

    route = make() if cache is None else cache.get(key, make)
    return apply_route(x, route, world_group, exchange=len(members) > 1)
