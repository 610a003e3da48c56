"""Who sends which image-token rows to whom in ``route``: pure (no process group).

``ColocatedBridgeCommunicator.route`` sends every image token from an encoder rank that
holds it straight to the LLM shard(s) that consume it. Everything happens inside one
**route group**: the ranks of one LLM DP replica for FAN_IN and EQUAL (they hold the
``k`` encoder replicas feeding it), the ranks of one encoder DP replica for FAN_OUT (they
hold the ``k`` LLM replicas it feeds); the nesting of the layouts makes these sets equal.

Tokens are named by their index ``g`` in the route group's **batch**: the samples of the
group in order (FAN_IN the LLM batch, FAN_OUT the encoder batch), their image tokens
sample-major. Member ``m`` *holds* a contiguous range of ``g`` (its encoder batch) and
*needs* the image tokens of its local shard (none on a later LLM pipeline stage: only
stage 0 consumes encoder rows): with the load-balanced CP cut and the SP
split, a shard's tokens are in ascending ``g`` order, so a shard is fully described by the
shard id (``cp_rank·pieces + sp_piece``) of every image token (:func:`image_token_shards`).

Choices (deterministic, the same on every rank; ``p(r)``: position in the group):

- forward, receiver ``q`` and token ``g``: ``q`` itself if it holds ``g``, else holder
  number ``p(q) mod |holders|`` (holders in group order).
- backward, encoder ``e`` and token ``g``: ``e`` itself if it consumed ``g`` (LLM TP
  replicas without SP consumed the same row and count once), else consumer number
  ``p(e) mod |consumers|``. Every holder gets every row's gradient (encoder TP replicas
  end with the same gradient).

Messages list their rows in ascending ``g`` in both directions, so sender and receiver
agree without exchanging indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.row_move import MoveLeg, RowMove
from mp_bridge.comm.sequence.padding import PaddedLayout

__all__ = [
    "RankRoute",
    "image_token_shards",
    "plan_route",
    "route_groups",
    "route_needs",
]


@dataclass(frozen=True)
class RankRoute:
    """One rank's ``route`` step: its group's ``members`` and its :class:`RowMove`
    ``rows`` (LongTensor indices; ``[...]`` per group member), read by the names below.

    - ``n_local``: output rows (image tokens of the local shard); ``x_rows``: input rows.
    - forward: ``keep_y``/``keep_x`` own rows; ``send_x[m]`` x rows for member ``m``;
      ``recv_y[m]`` output positions that ``m``'s rows fill, in message order.
    - backward: ``bwd_keep_y``/``bwd_keep_x``; ``bwd_send_y[m]`` output-gradient rows for
      ``m``; ``bwd_recv_x[m]`` the x rows ``m``'s gradient rows fill.
    """

    members: tuple[int, ...]
    rows: RowMove

    n_local = property(lambda self: self.rows.forward.dst_rows)
    x_rows = property(lambda self: self.rows.forward.src_rows)
    keep_y = property(lambda self: self.rows.forward.keep_dst)
    keep_x = property(lambda self: self.rows.forward.keep_src)
    send_x = property(lambda self: self.rows.forward.send)
    recv_y = property(lambda self: self.rows.forward.recv)
    bwd_keep_y = property(lambda self: self.rows.backward.keep_src)
    bwd_keep_x = property(lambda self: self.rows.backward.keep_dst)
    bwd_send_y = property(lambda self: self.rows.backward.send)
    bwd_recv_x = property(lambda self: self.rows.backward.recv)

    def fwd_rows(self) -> tuple[list[int], list[int]]:
        """Rows sent to / received from each member in the forward exchange."""
        return self.rows.forward.send_counts(), self.rows.forward.recv_counts()

    def bwd_rows(self) -> tuple[list[int], list[int]]:
        """Rows sent to / received from each member in the backward exchange."""
        return self.rows.backward.send_counts(), self.rows.backward.recv_counts()

    def move(self, *, exchange: bool) -> RowMove:
        """The :class:`RowMove` to run over the members' group. ``exchange``: whether the
        forward leg runs its collective (``False`` when every member holds every row it
        needs: FAN_OUT, EQUAL); the backward leg always does (group of > 1 rank)."""
        return RowMove(replace(self.rows.forward, exchange=exchange), self.rows.backward)


def image_token_shards(image_mask: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """Shard id (``cp_rank·pieces + sp_piece``) of every image token, sample-major.

    ``image_mask``: bool ``[B, S]`` (plain, ``layout.seq_len == S``) or ``[T]`` (packed,
    ``layout.bounds`` its documents). Returns LongTensor ``[n_image]`` on the CPU.
    """
    mask = image_mask.detach().to("cpu", torch.bool)
    shard = layout.shard_of_position()[layout.kept_positions()]  # [S] original order
    if mask.dim() == 2:
        return shard.expand_as(mask)[mask]
    return shard[mask]


def route_groups(plan: BridgePlan) -> tuple[tuple[int, ...], ...]:
    """The route groups (ascending ranks): one per LLM DP replica (FAN_IN, EQUAL) or per
    encoder DP replica (FAN_OUT)."""
    layout, axis = (
        (plan.src, "dp") if plan.direction is BridgeDirection.FAN_OUT else (plan.dest, "dp")
    )
    groups: dict[int, list[int]] = {}
    for r in layout.ranks:
        groups.setdefault(layout.coords(r)[axis], []).append(r)
    return tuple(tuple(sorted(g)) for _, g in sorted(groups.items()))


def route_needs(
    plan: BridgePlan,
    members: Sequence[int],
    *,
    pieces: int,
    src_totals: dict[int, int],
    dest_shards: dict[int, torch.Tensor],
) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """Each member's held ``g`` range and needed ``g`` (ascending) in its route group.

    ``src_totals``: image tokens of each encoder DP replica of the group (by src dp);
    ``dest_shards``: :func:`image_token_shards` of each LLM DP replica (by dest dp);
    ``pieces``: SP pieces per CP shard (the LLM tp with SP, else 1). With LLM PP > 1 a
    member off the first stage needs nothing (it still holds and sends its rows).
    """
    fan_out = plan.direction is BridgeDirection.FAN_OUT
    src_dps, dest_dps = sorted(src_totals), sorted(dest_shards)
    src_start, dest_start, total = {}, {}, 0
    for d in src_dps:
        src_start[d] = 0 if fan_out else total
        total += 0 if fan_out else src_totals[d]
    total = 0
    for d in dest_dps:
        dest_start[d] = total if fan_out else 0
        total += len(dest_shards[d]) if fan_out else 0
    holds, needs = [], []
    for m in members:
        s, d = plan.src.coords(m)["dp"], plan.dest.coords(m)
        size = sum(len(v) for v in dest_shards.values()) if fan_out else src_totals[s]
        holds.append((src_start[s], src_start[s] + size))
        if not plan.consumes(m):  # a later LLM stage: holds and sends, consumes nothing
            needs.append(torch.zeros(0, dtype=torch.long))
            continue
        shard = d.get("cp", 0) * pieces + (d["tp"] if pieces > 1 else 0)
        needs.append(dest_start[d["dp"]] + torch.nonzero(dest_shards[d["dp"]] == shard).reshape(-1))
    return holds, needs


Ranges = tuple[tuple[int, int], ...]


def _as_ranges(held: object) -> Ranges:
    """``(start, stop)`` or a sequence of them (ascending, disjoint) as a tuple of ranges."""
    if len(held) == 2 and all(isinstance(v, int) for v in held):  # type: ignore[arg-type]
        return ((int(held[0]), int(held[1])),)  # type: ignore[index]
    return tuple((int(a), int(b)) for a, b in held)  # type: ignore[union-attr]


class _Held:
    """One member's held ``g`` ranges: ``has(g)`` and ``row(g)`` (its x row of ``g``)."""

    def __init__(self, ranges: Ranges) -> None:
        self.starts = torch.tensor([a for a, _ in ranges], dtype=torch.long)
        self.stops = torch.tensor([b for _, b in ranges], dtype=torch.long)
        sizes = self.stops - self.starts
        self.offsets = torch.cumsum(sizes, 0) - sizes
        self.rows = int(sizes.sum())

    def _index(self, g: torch.Tensor) -> torch.Tensor:
        return (torch.searchsorted(self.starts, g, right=True) - 1).clamp(min=0)

    def has(self, g: torch.Tensor) -> torch.Tensor:
        if not len(self.starts):
            return torch.zeros(g.shape, dtype=torch.bool)
        i = self._index(g)
        return (g >= self.starts[i]) & (g < self.stops[i])

    def row(self, g: torch.Tensor) -> torch.Tensor:
        if not len(self.starts):
            return g[:0]
        i = self._index(g)
        return self.offsets[i] + g - self.starts[i]


def _sender_table(holds: Sequence[Ranges], total: int):
    """``(cuts, table)``: ``g`` in ``[cuts[i], cuts[i+1])`` has one holder set; for
    receiver ``q``, ``table[q, i]`` is holder number ``q mod |holders|`` (-1: none)."""
    ends = {min(max(v, 0), total) for rs in holds for ab in rs for v in ab}
    cuts = torch.tensor(sorted({0, total, *ends}), dtype=torch.long)
    n_cut = max(len(cuts) - 1, 1)
    holding = torch.zeros((len(holds), n_cut), dtype=torch.bool)  # [member, interval]
    for m, rs in enumerate(holds):
        for a, b in rs:
            i, j = torch.searchsorted(cuts, torch.tensor([a, b])).tolist()
            holding[m, i:j] = True
    count = holding.sum(0)  # holders per interval
    pairs = holding.t().nonzero()  # (interval, member), member ascending per interval
    first = torch.cumsum(count, 0) - count
    q = torch.arange(len(holds))[:, None]
    pick = first[None, :] + q % count.clamp(min=1)[None, :]
    table = pairs[:, 1][pick.clamp(max=max(len(pairs) - 1, 0))] if len(pairs) else pick
    table = torch.where(count[None, :] > 0, table, torch.full_like(pick, -1))
    return cuts, table


def plan_route(
    members: Sequence[int],
    rank: int,
    holds: Sequence[tuple[int, int] | Sequence[tuple[int, int]]],
    needs: Sequence[torch.Tensor],
) -> RankRoute:
    """``rank``'s :class:`RankRoute` given every member's held ranges and needed tokens.

    ``holds[m]``: ``(start, stop)``, or a list of ascending disjoint ranges (an encoder
    rank after balancing holds a union of images), of the ``g`` member ``m`` holds: its x
    rows are those ranges concatenated in order; ``needs[m]``: ascending ``g`` of its local
    shard's image tokens. Cost: ``O(G)`` plus, per other member, a few passes over both
    members' needs (no ``[members, G]`` matrix): holder sets are constant between range
    ends, and a token's consumers are ranked by one running count over the members.
    """
    members = tuple(members)
    me, n_members = members.index(rank), len(members)
    ranges = [_as_ranges(h) for h in holds]
    held_by = [_Held(r) for r in ranges]
    needs = [torch.as_tensor(n, dtype=torch.long).reshape(-1).cpu() for n in needs]
    ends = [b for rs in ranges for _, b in rs]
    total = max(ends + [int(n.max()) + 1 for n in needs if len(n)] + [0])
    count = torch.zeros(total, dtype=torch.long)  # members needing g
    before = []  # before[m][i]: members ahead of m needing needs[m][i]
    for need in needs:
        before.append(count[need])
        count[need] += 1
    cuts, table = _sender_table(ranges, total)
    local = held_by[me].row

    def held(m: int, g: torch.Tensor) -> torch.Tensor:
        return held_by[m].has(g)

    def sender(q: int, g: torch.Tensor) -> torch.Tensor:
        return table[q, torch.searchsorted(cuts, g, right=True) - 1]

    mine = needs[me]
    needed_by_me = torch.zeros(total, dtype=torch.bool)
    needed_by_me[mine] = True
    pos = torch.arange(len(mine))  # output row of mine[i] is i
    held_me = held(me, mine)
    from_m = sender(me, mine)
    empty = torch.zeros(0, dtype=torch.long)
    send_x, recv_y, bwd_send_y, bwd_recv_x = [], [], [], []
    for m in range(n_members):
        if m == me:
            for lst in (send_x, recv_y, bwd_send_y, bwd_recv_x):
                lst.append(empty)
            continue
        theirs = needs[m]
        send_x.append(local(theirs[~held(m, theirs) & (sender(m, theirs) == me)]))
        recv_y.append(pos[~held_me & (from_m == m)])
        # backward: encoder m gets g from its (m mod count)-th consumer, counted in order
        needed_by_m = torch.zeros(total, dtype=torch.bool)
        needed_by_m[theirs] = True
        unused_by_m = held(m, mine) & ~needed_by_m[mine]
        bwd_send_y.append(pos[unused_by_m & (m % count[mine] == before[me])])
        unused_by_me = held(me, theirs) & ~needed_by_me[theirs]
        bwd_recv_x.append(local(theirs[unused_by_me & (me % count[theirs] == before[m])]))
    kept, keep_x = pos[held_me], local(mine[held_me])
    x_rows, n_local = held_by[me].rows, len(mine)
    forward = MoveLeg(x_rows, n_local, keep_x, kept, tuple(send_x), tuple(recv_y), True)
    backward = MoveLeg(n_local, x_rows, kept, keep_x, tuple(bwd_send_y), tuple(bwd_recv_x), True)
    return RankRoute(members, RowMove(forward, backward))
