"""Which encoder DP replica encodes which image: a pure balance plan (no process group).

Images per sample are long-tailed, so encoder DP replicas that hold their own samples'
images carry very different work. :func:`plan_balance` reassigns **whole images** to
replicas so the estimated cost per replica is even. Its input is every replica's
per-image token counts (what one small all-gather gives every rank), its output a
:class:`BalancePlan`, identical on every rank (and so on the TP peers of a replica).

Cost of an image of ``t`` tokens: ``t² + c·t`` by default (attention is quadratic in the
image's tokens, the linears linear; ``c ≈ 2·hidden + ffn`` of the encoder weighs the two),
or a measured cost: a callable ``cost(tokens) -> costs`` on the int64 token counts of
every image, or a float tensor ``costs`` with one entry per image (replica-major).

Algorithm (host-side, deterministic: lists in replica/image order, ties to the lowest
index, no dict or set order). ``load(d)``: the sum of the costs on replica ``d``
(``math.fsum``, correctly rounded). Search: repeat with ``H`` the heaviest replica and
``L`` the lightest (lowest index among equals): among ``H``'s *own* images with
``0 < p < load(H) − load(L)`` move the one minimizing ``max(load(H) − p, load(L) + p)``
(nearest half the gap; lowest index on a tie) from ``H`` to ``L``; stop when there is none.
A moved image never moves again, so the search makes at most ``N`` moves
(``O(N·(m + n_H))`` in all: ``m`` replicas, ``n_H`` images on ``H``). The plan keeps the
search's moves up to the last one that lowered the maximum load; later moves (which only
even out replicas below a tied maximum) are dropped, so every kept move pays for itself.

Bound. A move lowers the pair's larger load and leaves both above the old minimum, so the
maximum never rises and the minimum never falls. When the search stops, with ``p_max``
the largest image cost, ``max − min ≤ p_max``: either every own image of ``H`` has
``p ≥ max − min``, or ``H``'s load came from the last image it received while it was the
lightest. With ``min ≤ (total − max)/(m − 1)`` this is Graham's list-scheduling bound
``max ≤ mean + p_max·(m − 1)/m``, and since any assignment has ``OPT ≥ max(mean, p_max)``,
``max ≤ (2 − 1/m)·OPT``. The kept prefix has the same maximum. So: **the plan's maximum is
at most** ``mean + p_max·(m − 1)/m`` **and at most the maximum before; it is strictly lower
whenever an image moves, and nothing moves when the search cannot lower the maximum**
(equal loads, or no image of the heaviest replica fits the gap).

Layout after the plan: replica ``e`` holds its images ordered by (source replica, source
index), i.e. kept and received images in global order, which is exactly the order in
which one ``all_to_all_single`` delivers them (sources in group order, each source's
images in its own order).

Worked example (``c = 0``, so ``cost = t²``), 3 replicas::

    tokens    replica 0: [4, 1, 3]   replica 1: [2]   replica 2: [1, 1]
    loads     26, 4, 2               (16+1+9, 4, 1+1)
    move 1    H=0, L=2, gap 24: own images 16, 1, 9 all < 24; 9 is nearest 12 -> 0:2 to 2
    loads     17, 4, 11
    move 2    H=0, L=1, gap 13: own images 16, 1 (< 13: only 1) -> 0:1 to 1
    loads     16, 5, 11
    stop      H=0, L=1, gap 11: own image 16 >= 11 (max − min = 11 <= p_max = 16)

    dest      replica 0: [0:0]   replica 1: [0:1, 1:0]   replica 2: [0:2, 2:0, 2:1]
    replica 0 sends rows (4, 1, 3) to replicas (0, 1, 2), receives (4, 0, 0)
    replica 1 sends (0, 2, 0), receives (1, 2, 0)
    replica 2 sends (0, 0, 2), receives (3, 0, 2)

(``i:j`` is image ``j`` of replica ``i``; the rows a replica sends itself stay local.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mp_bridge.checks import check_float, check_ints
from mp_bridge.comm.bridge.plans.row_move import MoveLeg, RowMove

__all__ = ["BalancePlan", "ImageMove", "image_costs", "plan_balance"]

Cost = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ImageMove:
    """One image: ``tokens`` rows from (``src``, ``src_index``) to (``dest``, ``dest_index``)."""

    src: int
    src_index: int
    dest: int
    dest_index: int
    tokens: int


@dataclass(frozen=True)
class BalancePlan:
    """Where every image is encoded; the same on every rank.

    ``tokens[d]``/``costs[d]``: replica ``d``'s images before the plan (its own order);
    ``dest[d][j]``/``dest_index[d][j]``: the replica that encodes image ``j`` of replica
    ``d`` and its position there. ``loads_before``/``loads_after``: cost per replica.
    """

    tokens: tuple[tuple[int, ...], ...]
    costs: tuple[tuple[float, ...], ...]
    dest: tuple[tuple[int, ...], ...]
    dest_index: tuple[tuple[int, ...], ...]
    loads_before: tuple[float, ...]
    loads_after: tuple[float, ...]

    def __repr__(self) -> str:
        return (
            f"BalancePlan(replicas={self.replicas}, images={self.num_images}, "
            f"moved={self.moved_images}, max/mean {self.ratio_before():.3f} -> "
            f"{self.ratio_after():.3f})"
        )

    @property
    def replicas(self) -> int:
        return len(self.tokens)

    @property
    def num_images(self) -> int:
        return sum(len(t) for t in self.tokens)

    def moves(self) -> tuple[ImageMove, ...]:
        """Every image (moved or kept), in (source replica, source index) order."""
        return tuple(
            ImageMove(d, j, self.dest[d][j], self.dest_index[d][j], t)
            for d, ts in enumerate(self.tokens)
            for j, t in enumerate(ts)
        )

    @property
    def moved_images(self) -> int:
        return sum(e != d for d, es in enumerate(self.dest) for e in es)

    @property
    def moved_rows(self) -> int:
        """Rows that cross replicas (each moved image's tokens, once)."""
        return sum(m.tokens for m in self.moves() if m.dest != m.src)

    def send_rows(self, replica: int) -> tuple[int, ...]:
        """Rows ``replica`` sends to each replica (its own entry: the rows it keeps)."""
        out = [0] * self.replicas
        for e, t in zip(self.dest[replica], self.tokens[replica]):
            out[e] += t
        return tuple(out)

    def recv_rows(self, replica: int) -> tuple[int, ...]:
        """Rows ``replica`` receives from each replica (its own entry: the rows it keeps)."""
        return tuple(self.send_rows(d)[replica] for d in range(self.replicas))

    def send_order(self, replica: int) -> torch.Tensor:
        """LongTensor ``[T_local]``: ``replica``'s rows in send order (by destination, then
        image order): ``x[send_order]`` split by :meth:`send_rows` is the forward message."""
        starts = [0]
        for t in self.tokens[replica]:
            starts.append(starts[-1] + t)
        dest = self.dest[replica]
        by_dest = sorted(range(len(dest)), key=lambda j: (dest[j], j))
        parts = [torch.arange(starts[j], starts[j + 1]) for j in by_dest]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def row_move(self, replica: int) -> RowMove:
        """``replica``'s :class:`RowMove` over the DP group (group rank = replica): forward
        each image's rows to the replica that encodes it (received in source order, its
        kept rows copied locally), backward the inverse move (``forward.reversed()``)."""
        order, send_rows = self.send_order(replica), self.send_rows(replica)
        recv_rows = self.recv_rows(replica)
        cut = [sum(send_rows[:e]) for e in range(self.replicas + 1)]
        at = [sum(recv_rows[:d]) for d in range(self.replicas + 1)]
        empty = order[:0]
        send = tuple(empty if e == replica else order[cut[e] : cut[e + 1]]
                     for e in range(self.replicas))  # fmt: skip
        recv = tuple(empty if d == replica else torch.arange(at[d], at[d + 1])
                     for d in range(self.replicas))  # fmt: skip
        keep_x = order[cut[replica] : cut[replica + 1]]
        keep_y = torch.arange(at[replica], at[replica + 1])
        forward = MoveLeg(len(order), at[-1], keep_x, keep_y, send, recv, exchange=True)
        return RowMove(forward, forward.reversed())

    def tokens_after(self, replica: int) -> tuple[int, ...]:
        """Tokens per image of ``replica``'s batch after the plan (its new image order)."""
        return tuple(
            t
            for d in range(self.replicas)
            for t, e in zip(self.tokens[d], self.dest[d])
            if e == replica
        )

    def ratio_before(self) -> float:
        """``max / mean`` of the loads before the plan (1.0 for no load)."""
        return _ratio(self.loads_before)

    def ratio_after(self) -> float:
        return _ratio(self.loads_after)


def _ratio(loads: Sequence[float]) -> float:
    mean = math.fsum(loads) / max(len(loads), 1)
    return max(loads) / mean if mean > 0 else 1.0


def _check_costs(name: str, values: torch.Tensor, n: int) -> list[float]:
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
        raise TypeError(
            f"{name} must give a float tensor of one cost per image, got "
            f"{getattr(values, 'dtype', type(values).__name__)}"
        )
    if values.shape != (n,):
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}; pass one cost per image, shape ({n},), "
            f"replica-major (replica 0's images first)"
        )
    flat = values.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()):
        raise ValueError(f"{name}={flat.tolist()[:8]} must be finite and >= 0 per image")
    return flat.tolist()


def image_costs(
    tokens_per_image: Sequence[Sequence[int]],
    *,
    c: float = 0.0,
    cost: Cost | torch.Tensor | None = None,
) -> tuple[tuple[float, ...], ...]:
    """Each image's estimated cost, per replica: ``t² + c·t``, ``cost(tokens)`` (a callable
    on the int64 ``[N]`` counts, replica-major) or ``cost`` itself (a float ``[N]`` tensor)."""
    if isinstance(tokens_per_image, (str, bytes)) or not isinstance(tokens_per_image, Sequence):
        raise TypeError(
            f"tokens_per_image must be a list with one list of token counts per encoder DP "
            f"replica, got {type(tokens_per_image).__name__}"
        )
    if not tokens_per_image:
        raise ValueError("tokens_per_image is empty; pass one list per encoder DP replica")
    rows = [
        check_ints(
            f"tokens_per_image[{d}]",
            list(t) if isinstance(t, tuple) else t,
            low=1,
            fix="every image has >= 1 token (a text-only sample has no image)",
        )
        for d, t in enumerate(tokens_per_image)
    ]
    c = check_float("c", c, low=0.0, high=math.inf, open_high=True)
    n = sum(len(r) for r in rows)
    if cost is None:
        flat = [float(t) * float(t) + c * float(t) for r in rows for t in r]
    elif isinstance(cost, torch.Tensor):
        flat = _check_costs("cost", cost, n)
    elif callable(cost):
        counts = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
        flat = _check_costs("cost(tokens)", cost(counts), n)
    else:
        raise TypeError(
            f"cost must be None (t² + c·t), a callable on the token counts or a float tensor "
            f"of per-image costs, got {type(cost).__name__}"
        )
    out, start = [], 0
    for r in rows:
        out.append(tuple(flat[start : start + len(r)]))
        start += len(r)
    return tuple(out)


def _search(costs: Sequence[Sequence[float]]) -> list[tuple[int, int, int]]:
    """The accepted moves ``(replica, image, to)`` of the search (module docstring)."""
    m = len(costs)
    on = [[(d, j) for j in range(len(cs))] for d, cs in enumerate(costs)]  # (src, index)
    loads = [math.fsum(cs) for cs in costs]
    moves, maxima = [], [max(loads)]
    for _ in range(sum(len(cs) for cs in costs)):
        heavy = min(range(m), key=lambda d: (-loads[d], d))
        light = min(range(m), key=lambda d: (loads[d], d))
        gap = loads[heavy] - loads[light]
        best, best_key = None, None
        for pos, (d, j) in enumerate(on[heavy]):
            p = costs[d][j]
            if d != heavy or not 0 < p < gap:
                continue
            key = (max(loads[heavy] - p, loads[light] + p), j)
            if best_key is None or key < best_key:
                best, best_key = pos, key
        if best is None:
            break
        d, j = on[heavy].pop(best)
        on[light].append((d, j))
        moves.append((d, j, light))
        loads[heavy] = math.fsum(costs[a][b] for a, b in on[heavy])
        loads[light] = math.fsum(costs[a][b] for a, b in on[light])
        maxima.append(max(loads))
    # keep the moves up to the last one that lowered the maximum (the rest only evened
    # out replicas below it): the maximum is the full search's, and ties stay home
    return moves[: maxima.index(maxima[-1])]


def plan_balance(
    tokens_per_image: Sequence[Sequence[int]],
    *,
    c: float = 0.0,
    cost: Cost | torch.Tensor | None = None,
) -> BalancePlan:
    """The :class:`BalancePlan` for every replica's per-image token counts (module docstring).

    ``tokens_per_image[d]``: replica ``d``'s images' token counts (each >= 1; an empty
    list for a replica without images). ``c``/``cost``: see :func:`image_costs`.
    """
    costs = image_costs(tokens_per_image, c=c, cost=cost)  # validates tokens_per_image
    tokens = tuple(tuple(int(t) for t in r) for r in tokens_per_image)
    m = len(costs)
    dest = [[d] * len(cs) for d, cs in enumerate(costs)]
    for d, j, e in _search(costs):
        dest[d][j] = e
    on = [
        sorted((d, j) for d in range(m) for j, e in enumerate(dest[d]) if e == r) for r in range(m)
    ]
    index = [[0] * len(cs) for cs in costs]
    for e in range(m):
        for k, (d, j) in enumerate(on[e]):
            index[d][j] = k
    return BalancePlan(
        tokens=tokens,
        costs=costs,
        dest=tuple(tuple(r) for r in dest),
        dest_index=tuple(tuple(r) for r in index),
        loads_before=tuple(math.fsum(cs) for cs in costs),
        loads_after=tuple(math.fsum(costs[d][j] for d, j in on[e]) for e in range(m)),
    )
