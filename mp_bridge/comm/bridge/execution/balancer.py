"""Balanced encoders, execution: share the image counts, plan, move whole images once.

One rank's :meth:`ImageBalancer.balance` (the plan is
:mod:`~mp_bridge.comm.bridge.plans.balance_plan`):

1. Local validation (``TypeError``/``ValueError`` before any collective).
2. **One** all-gather over ``count_group`` (every encoder rank, TP × DP) of a fixed-size
   int64 row per rank (:func:`balance_row`, ``8·(HEADER + cap)`` bytes, ``8·(HEADER + 2·cap)``
   with measured costs): the replica, its number of images and tokens, a fingerprint of
   its counts (and costs), a code of its :class:`BalanceSpec`, then its first ``cap``
   token counts (and cost bits). A second all-gather, of the exact ``max_images`` width,
   runs only when some replica holds more than ``cap`` images (every rank sees that in
   the first, so all run it). Every rank compares the same rows: TP peers of a replica
   that pass different counts, or ranks with different specs (``c``, cost, row shape,
   dtype), make every rank raise the same ``ValueError`` (the spec case through
   :func:`mp_bridge.checks.agree`, which names the field, ranks and values).
3. :func:`plan_balance` on the gathered counts: identical on every rank, cached
   (:class:`PlanCache`, keyed by the counts and costs).
4. **One** ``all_to_all_single`` over ``dp_group`` (the encoder DP group of this TP rank,
   group rank = replica index): each image's ``[t, *rest]`` rows go from their replica to
   the one that encodes them, TP rank ``t`` to TP rank ``t``, so the TP peers of a
   replica receive the same images. Exact splits: a rank receives exactly the rows of
   the images moved to it (its kept rows stay local); nothing runs when no image moves.

Adjoint: moving rows by the plan is a permutation of rows across ranks, so its adjoint is
the inverse move: :meth:`BalancePlan.row_move` is a
:class:`~mp_bridge.comm.bridge.plans.row_move.RowMove` whose backward is its forward
reversed, run by :func:`~mp_bridge.comm.bridge.execution.row_move.adjoint_move` (backward
applies the inverse move: the same ``all_to_all_single`` with the splits swapped, rows put
back in source order), so ``backward(create_graph=True)`` records the collective too.
:meth:`ImageBalancer.restore` is the inverse move of any per-row result (e.g. the encoded
features ``[T_after, h]``) back to the source replica's order.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import (
    FrozenSpec,
    agree,
    agreed,
    check_float,
    check_group,
    check_int,
    check_ints,
    check_tensor,
    fingerprint,
)
from mp_bridge.comm.bridge.execution.headers import gather_headers
from mp_bridge.comm.bridge.execution.row_move import adjoint_move
from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan, image_costs, plan_balance
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.comm.collectives.primitives import group_rank, group_size

__all__ = ["BalanceSpec", "ImageBalancer", "RestoreSpec", "move_images", "return_images"]

HEADER = ("rank", "replica", "images", "tokens", "counts print", "spec code", "costs print")
_WHERE = "ImageBalancer.balance"


@dataclass(frozen=True)
class BalanceSpec(FrozenSpec):
    """What every encoder rank must hold equal: the cost model (``c``, ``cost``: the
    callable's name), the rows' ``x.shape[1:]`` and dtype, and the count row's ``cap``."""

    c: float
    cost: str
    row_shape: tuple[int, ...]
    dtype: str
    cap: int

    def code(self) -> int:
        return zlib.crc32(repr(sorted(self.fields().items())).encode())


def _local_counts(tokens_per_image: object, rows: int) -> tuple[int, ...]:
    if isinstance(tokens_per_image, torch.Tensor):
        check_tensor("tokens_per_image", tokens_per_image, dtype="int")
        if tokens_per_image.dim() != 1:
            raise ValueError(
                f"tokens_per_image has shape {tuple(tokens_per_image.shape)}; pass a 1-D "
                f"tensor with one token count per image of this replica"
            )
        tokens_per_image = tokens_per_image.tolist()
    counts = check_ints(
        "tokens_per_image",
        tokens_per_image,
        low=1,
        fix="one count per image of this replica, each >= 1 (a text-only sample has none)",
    )
    if sum(counts) != rows:
        raise ValueError(
            f"tokens_per_image sums to {sum(counts)} but x has {rows} rows (x.shape[0]); "
            f"pass one count per image, summing to x.shape[0]"
        )
    return counts


def _local_costs(costs: object, n: int) -> torch.Tensor | None:
    if costs is None:
        return None
    check_tensor("costs", costs, dtype="float")
    flat = costs.detach().to("cpu", torch.float64)
    if flat.shape != (n,) or not bool(torch.isfinite(flat).all()) or bool((flat < 0).any()):
        raise ValueError(
            f"costs has shape {tuple(costs.shape)} (values {flat.reshape(-1).tolist()[:4]}); "
            f"pass one finite cost >= 0 per image of this replica, shape ({n},)"
        )
    return flat


@dataclass(frozen=True)
class RestoreSpec(FrozenSpec):
    """What the replicas of one :meth:`ImageBalancer.restore` compare: the rows' shape and
    dtype, and the plan (every replica's counts and where each image was encoded)."""

    row_shape: tuple[int, ...]
    dtype: str
    tokens: tuple[tuple[int, ...], ...]
    dest: tuple[tuple[int, ...], ...]


def balance_row(rank, replica, counts, costs, spec: BalanceSpec) -> list[int]:
    """This rank's fixed-size row: ``HEADER`` then ``cap`` counts (-1 padded) and, with
    measured costs, ``cap`` cost bits (float64 viewed as int64)."""
    c = torch.tensor(counts, dtype=torch.int64)
    bits = costs.view(torch.int64) if costs is not None else None
    head = [rank, replica, len(counts), sum(counts), int(fingerprint(c)), spec.code(),
            0 if bits is None else int(fingerprint(bits))]  # fmt: skip
    return head + _padded(c, spec.cap) + ([] if bits is None else _padded(bits, spec.cap))


def _padded(values: torch.Tensor, width: int) -> list[int]:
    out = values[:width].tolist()
    return out + [-1] * (width - len(out))


def _mismatch(rows: list[list[int]], cap: int) -> str | None:
    """The first replica whose TP ranks passed different counts, as a sentence."""
    by_replica: dict[int, list[list[int]]] = {}
    for r in sorted(rows, key=lambda r: (r[1], r[0])):
        by_replica.setdefault(r[1], []).append(r)
    n = len(HEADER)
    for d in sorted(by_replica):
        first, *rest = by_replica[d]
        for other in rest:
            if other[2:5] == first[2:5] and other[6:] == first[6:]:
                continue

            def show(r):
                shown = r[n : n + min(r[2], cap)]
                more = "..." if r[2] > cap else ""
                return f"rank {r[0]} passes {r[2]} images of {r[3]} tokens {shown}{more}"

            return (
                f"{_WHERE}: the TP ranks of encoder DP replica {d} disagree on "
                f"tokens_per_image (or costs): {show(first)}, {show(other)}; every TP rank "
                f"of an encoder DP replica passes the same tokens_per_image and costs "
                f"(checked over every encoder rank: every rank raises this error)"
            )
    return None


def gather_counts(
    counts: tuple[int, ...],
    costs: torch.Tensor | None,
    spec: BalanceSpec,
    *,
    replica: int,
    replicas: int,
    group,
    device,
) -> tuple[tuple[tuple[int, ...], ...], torch.Tensor | None]:
    """Every replica's token counts (and, with ``costs``, the ``[N]`` replica-major costs),
    checked on every rank of ``group`` (steps 2 of the module docstring)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = gather_headers(balance_row(rank, replica, counts, costs, spec), group, device=device)
    if len({r[5] for r in rows}) > 1:
        agree(_WHERE, group, spec, device=device, always=True)
        raise ValueError(f"{_WHERE}: the ranks' balance specs differ; {spec.fields()}")
    problem = _mismatch(rows, spec.cap)
    if problem:
        raise ValueError(problem)
    if {r[1] for r in rows} != set(range(replicas)):
        raise ValueError(
            f"{_WHERE}: count_group holds replicas {sorted({r[1] for r in rows})}, expected "
            f"0..{replicas - 1}; pass count_group spanning every rank of the encoder grid"
        )
    rep = {r[1]: r for r in rows}
    widest, n, measured = max(r[2] for r in rows), len(HEADER), costs is not None
    if widest > spec.cap:  # the rows hold the first cap counts only: fetch the rest
        c = torch.tensor(counts, dtype=torch.int64)
        full = _padded(c, widest) + (_padded(costs.view(torch.int64), widest) if measured else [])
        rep = {r[1]: r[:n] + f for r, f in zip(rows, gather_headers(full, group, device=device))}
    width = max(widest, spec.cap)
    tokens = tuple(tuple(rep[d][n : n + rep[d][2]]) for d in range(replicas))
    if not measured:
        return tokens, None
    bits = [v for d in range(replicas) for v in rep[d][n + width : n + width + rep[d][2]]]
    return tokens, torch.tensor(bits, dtype=torch.int64).view(torch.float64)


def _check_rows(name: str, t: object, rows: int, what: str) -> torch.Tensor:
    check_tensor(name, t)
    if t.dim() < 1 or t.shape[0] != rows:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [{rows}, *rest]: {what} rows "
            f"of this replica in the plan"
        )
    return t


def move_images(x: torch.Tensor, plan: BalancePlan, replica: int, group) -> torch.Tensor:
    """``[T_before, *rest] -> [T_after, *rest]``: whole images to their encoding replica
    (``plan.tokens_after(replica)`` gives the new per-image counts). ``x`` itself when no
    image moves. Collective: one ``all_to_all_single`` over ``group`` (dp, replica order)."""
    _check_rows("x", x, sum(plan.tokens[replica]), "the source")
    if plan.moved_images == 0:
        return x
    return adjoint_move(x, plan.row_move(replica), group)


def return_images(y: torch.Tensor, plan: BalancePlan, replica: int, group) -> torch.Tensor:
    """The inverse of :func:`move_images`: ``[T_after, *rest] -> [T_before, *rest]``."""
    _check_rows("y", y, sum(plan.tokens_after(replica)), "the encoded")
    if plan.moved_images == 0:
        return y
    return adjoint_move(y, plan.row_move(replica).inverse(), group)


class ImageBalancer:
    """Balance whole images over encoder DP replicas (see the module docstring).

    ``dp_group``: this rank's encoder DP group (one rank per replica, same TP rank; group
    rank = replica); ``count_group``: every encoder rank (TP × DP; default ``dp_group``,
    enough when encoder TP is 1). ``c``/``cost``: the cost model (:func:`image_costs`;
    ``cost`` a callable, the same function on every rank). ``cap``: counts per replica
    carried by the first all-gather.
    """

    def __init__(
        self,
        *,
        dp_group: dist.ProcessGroup | None,
        count_group: dist.ProcessGroup | None = None,
        c: float = 0.0,
        cost: Callable[[torch.Tensor], torch.Tensor] | None = None,
        cap: int = 64,
        cache_size: int = 8,
    ) -> None:
        self.dp_group = check_group("dp_group", dp_group)
        check_group("count_group", count_group)
        self.count_group = dp_group if count_group is None else count_group
        self.c = check_float("c", c, low=0.0)
        if cost is not None and not callable(cost):
            raise TypeError(f"cost must be None or a callable on token counts, got {cost!r}")
        self.cost, self.cap = cost, check_int("cap", cap, low=1)
        self.cache = PlanCache(check_int("cache_size", cache_size, low=1))
        self.replica, self.replicas = group_rank(dp_group), group_size(dp_group)

    def spec(self, x: torch.Tensor) -> BalanceSpec:
        name = "t^2+c*t" if self.cost is None else getattr(self.cost, "__qualname__", "cost")
        return BalanceSpec(self.c, name, tuple(x.shape[1:]), str(x.dtype), self.cap)

    @agreed("mp_bridge.comm.ImageBalancer.plan")
    def plan(
        self, x: torch.Tensor, tokens_per_image: object, *, costs: torch.Tensor | None = None
    ) -> BalancePlan:
        """Steps 1-3: the plan for every replica's images (``costs``: this replica's
        measured per-image costs, overriding the cost model)."""
        check_tensor("x", x)
        if x.dim() < 1:
            raise ValueError(f"x has shape {tuple(x.shape)}; pass the image rows [T, *rest]")
        counts = _local_counts(tokens_per_image, x.shape[0])
        measured = _local_costs(costs, len(counts))
        tokens, flat = gather_counts(
            counts, measured, self.spec(x), replica=self.replica, replicas=self.replicas,
            group=self.count_group, device=x.device,
        )  # fmt: skip
        if flat is None and self.cost is not None:  # a callable may change: key its values
            flat = torch.tensor(sum(image_costs(tokens, cost=self.cost), ()), dtype=torch.float64)
        key = (tokens, self.c, None if flat is None else flat.numpy().tobytes())
        return self.cache.get(key, lambda: plan_balance(tokens, c=self.c, cost=flat))

    @agreed("mp_bridge.comm.ImageBalancer.balance")
    def balance(
        self, x: torch.Tensor, tokens_per_image: object, *, costs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, BalancePlan]:
        """``(y, plan)``: ``y`` ``[T_after, *rest]`` the images this replica encodes,
        ``plan.tokens_after(self.replica)`` their token counts."""
        plan = self.plan(x, tokens_per_image, costs=costs)
        return move_images(x, plan, self.replica, self.dp_group), plan

    @agreed("mp_bridge.comm.ImageBalancer.restore")
    def restore(self, y: torch.Tensor, plan: BalancePlan) -> torch.Tensor:
        """Per-row results ``[T_after, *rest]`` back to the source order ``[T_before, *rest]``.

        The replicas agree (over ``dp_group``) on the rows' shape and dtype and on the
        plan (:class:`RestoreSpec`) before the move."""
        _check_rows("y", y, sum(plan.tokens_after(self.replica)), "the encoded")
        spec = RestoreSpec(tuple(y.shape[1:]), str(y.dtype), plan.tokens, plan.dest)
        agree("ImageBalancer.restore", self.dp_group, spec, device=y.device)
        return return_images(y, plan, self.replica, self.dp_group)
