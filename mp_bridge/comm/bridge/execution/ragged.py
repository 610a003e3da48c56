"""Ragged bridge execution: exact-bytes token exchange and its autograd Functions.

``bridge_ragged`` runs one rank's :class:`~mp_bridge.comm.bridge.plans.ragged.RaggedRoute`:

=========  ==============================================  ===================================
direction  forward                                         backward (adjoint)
=========  ==============================================  ===================================
FAN_IN     header all-gather, then the counted gather      [CP all-reduce] narrow
FAN_OUT    narrow (local copy of own slot)                 [CP all-reduce] gather
EQUAL      copy                                            [CP all-reduce]
=========  ==============================================  ===================================

Collective: ``all_to_all_single`` with split sizes. Every member sends its rows to every
member and receives exactly each member's rows (its own come back locally), so the bytes
received are exactly the other slots' tokens, no padding to the largest member; gloo and
NCCL both support uneven splits, whereas gloo's ``all_gather`` needs equal sizes.

Counts: FAN_IN first all-gathers a fixed-size int64 header per member (samples, tokens,
row numel, a code of the row shape and dtype): the call's one agreement, so a member
passing a different number of samples (or another row shape or dtype) raises the same
``ValueError`` on every rank of the group instead of hanging; nothing after it is checked
again (the token exchange trusts it).
The per-sample counts then ride in the token exchange as an ``8·n``-byte prefix of each
message (the exchange moves bytes), so FAN_IN forward is two collectives: one small header
all-gather (``4·8`` bytes per member) and one token exchange. FAN_OUT computes every slot's
size from its local counts: no forward collective, one exchange backward.

The CP all-reduce (dest CP > 1) is ``copy_to_group`` applied after the direction step, so
backward sums the incoming gradient over the dest CP group first (see ``dense.py``).
The gather and the narrow are one :class:`~mp_bridge.comm.bridge.plans.row_move.RowMove`
and its inverse (:func:`~mp_bridge.comm.bridge.plans.row_move.gather_move`), run by
:func:`~mp_bridge.comm.bridge.execution.row_move.adjoint_move`, whose backward applies
the inverse move, so ``backward(create_graph=True)`` records the backward collective too.
FAN_IN's forward keeps its own Function (``_GatherCounted``) only because it carries the
counts in the byte message: folding them into the row move would cost a second
collective (another dtype, sizes the receiver learns from them), or a padded count row.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import FrozenSpec, agree, agreed
from mp_bridge.comm.bridge.execution.headers import differing_field, gather_headers, show_field
from mp_bridge.comm.bridge.execution.row_move import adjoint_move, run_leg
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.ragged import check_member_headers, route_ragged_trusted
from mp_bridge.comm.bridge.plans.row_move import gather_move
from mp_bridge.comm.collectives.primitives import copy_to_group, group_rank, group_size

__all__ = ["bridge_ragged", "exchange_rows", "exchange_rows_trusted"]

HEADER_FIELDS = ("samples", "tokens", "row numel", "row code")


# ------------------------------------------------------- plain (non-autograd) exchange
@dataclass(frozen=True)
class _ExchangeSpec(FrozenSpec):
    """What the members of one :func:`exchange_rows` compare: every member's row count
    (the same list on each), the row shape, the dtype and the number of counts."""

    slot_rows: tuple[int, ...]
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    counts: int | None


@agreed("mp_bridge.comm.exchange_rows")
def exchange_rows(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    slot_rows: Sequence[int],
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Send all of ``x`` ``[r, *rest]`` to every member; return every member's rows.

    ``slot_rows``: rows of each member in group rank order (``x.shape[0]`` at this rank's
    own position). Returns ``y`` ``[sum(slot_rows), *rest]``, member ``m``'s rows at its
    slot range, and, when ``counts`` (int64 ``[n]``, the same ``n`` on every member) is
    given, the members' counts ``[k, n]`` (else ``None``). One ``all_to_all_single``; this
    rank receives exactly the other members' rows (plus ``8·n`` bytes each with counts).
    """
    k = len(slot_rows)
    if k != group_size(group) or slot_rows[group_rank(group)] != x.shape[0]:
        raise ValueError(
            f"slot_rows={list(slot_rows)} must hold one row count per group member "
            f"({group_size(group)}), with x.shape[0]={x.shape[0]} at this rank's position "
            f"{group_rank(group)}"
        )
    n = None if counts is None else counts.numel()
    spec = _ExchangeSpec(tuple(slot_rows), tuple(x.shape[1:]), x.dtype, n)
    agree("exchange_rows", group, spec, device=x.device)
    return exchange_rows_trusted(x, group, slot_rows, counts)


def exchange_rows_trusted(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    slot_rows: Sequence[int],
    counts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`exchange_rows` after its checks (``bridge_ragged``'s header agreed on them)."""
    k = len(slot_rows)
    if k == 1:  # a single process (group None or of size 1): nothing to exchange
        return x.clone(), None if counts is None else counts.reshape(1, -1).clone()
    if counts is None:  # the plain gather: a RowMove, run by row_move
        return run_leg(x, gather_move(slot_rows, group_rank(group)).forward, group), None
    rest = tuple(x.shape[1:])
    y = x.new_empty((sum(slot_rows), *rest))
    # Counts and tokens in one message of bytes: [counts (8n bytes) | tokens], written
    # once per member straight into the send buffer (no intermediate message copy).
    row_bytes = math.prod(rest) * x.element_size()
    head = counts.to(device=x.device, dtype=torch.int64).reshape(-1).view(torch.uint8)
    width = head.numel() + x.numel() * x.element_size()
    send = torch.empty(k, width, dtype=torch.uint8, device=x.device)
    send[:, : head.numel()] = head
    send[:, head.numel() :] = _as_bytes(x)
    recv = [head.numel() + r * row_bytes for r in slot_rows]
    buf = torch.empty(sum(recv), dtype=torch.uint8, device=x.device)
    dist.all_to_all_single(buf, send.reshape(-1), recv, [send.shape[1]] * k, group=group)
    y_bytes = _as_bytes(y)  # a view: writing it fills y
    heads, start, out = [], 0, 0
    for size in recv:
        heads.append(buf[start : start + head.numel()])
        n_bytes = size - head.numel()
        y_bytes[out : out + n_bytes].copy_(buf[start + head.numel() : start + size])
        start, out = start + size, out + n_bytes
    received = torch.cat(heads).view(torch.int64).reshape(k, counts.numel())
    return y, received


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _exchange_headers(
    x: torch.Tensor, n_samples: int, group: dist.ProcessGroup | None
) -> list[list[int]]:
    """One fixed-size int64 header per member (``HEADER_FIELDS``; the row code is a CRC
    of the row shape and dtype, so the header is the call's whole agreement)."""
    header = [n_samples, x.shape[0], math.prod(x.shape[1:]), _row_code(x)]
    return gather_headers(header, group, device=x.device)


def _row_code(x: torch.Tensor) -> int:
    return zlib.crc32(repr((tuple(x.shape[1:]), str(x.dtype))).encode())


def _check_rows(members: Sequence[int], headers: list[list[int]]) -> None:
    what = differing_field(headers, {"sizes": 2, "shapes or dtypes": 3})
    if what == "sizes":
        per_rank = show_field(members, headers, 2, lambda n: f"{n} elements")
    elif what is not None:
        per_rank = show_field(members, headers, 3, lambda c: f"code {c:#x}")
    else:
        return
    raise ValueError(
        f"the ranks of gather group {list(members)} passed tokens of different row "
        f"{what} in x ({per_rank}); every member's x must be [T, *rest] with the same "
        f"rest and dtype"
    )


# ----------------------------------------------------------------- autograd ops
class _GatherCounted(torch.autograd.Function):
    """Forward: :func:`exchange_rows_trusted` with the counts in the byte message (every
    member's rows, slot order, and its counts). Backward: the narrow to this rank's slot
    (``adjoint_move`` of ``gather_move(...).inverse()``, whose own backward is the gather:
    double-differentiable like every ragged step)."""

    @staticmethod
    def forward(ctx, x, group, slot, slot_rows, counts):
        ctx.group, ctx.slot, ctx.slot_rows = group, slot, slot_rows
        y, received = exchange_rows_trusted(x, group, slot_rows, counts)
        ctx.mark_non_differentiable(received)
        return y, received

    @staticmethod
    def backward(ctx, grad, _grad_counts):
        narrow = gather_move(ctx.slot_rows, ctx.slot).inverse()
        return adjoint_move(grad, narrow, ctx.group), None, None, None, None


def bridge_ragged(
    x: torch.Tensor,
    counts: tuple[int, ...],
    *,
    plan: BridgePlan,
    rank: int,
    gather_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's ragged bridge step; see ``ColocatedBridgeCommunicator.communicate_ragged``.

    ``x`` ``[T, *rest]`` and ``counts`` (``tokens_per_sample`` parsed by
    :func:`~mp_bridge.comm.bridge.plans.token_counts.check_tokens_per_sample`) are trusted:
    the communicator checked them. Returns ``(y, dest_tokens_per_sample)``: ``y``
    ``[T_dest, *rest]`` (never aliasing ``x``), ``dest_tokens_per_sample`` a CPU int64
    tensor ``[B_dest_local]``.
    """
    k, slot, direction = plan.scale, plan.slot_of(rank), plan.direction
    if direction is BridgeDirection.FAN_IN:
        members = plan.gather_group_of(rank)
        headers = _exchange_headers(x, len(counts), gather_group)
        # The header is the call's one agreement: every member sees the same headers, so
        # every member raises the same error; after it nothing is checked again.
        check_member_headers(members, [h[0] for h in headers])
        _check_rows(members, headers)
        slot_tokens = tuple(h[1] for h in headers)
        own = torch.tensor(counts, dtype=torch.int64)
        y, received = _GatherCounted.apply(x, gather_group, slot, slot_tokens, own)
        route = route_ragged_trusted(plan, rank, [tuple(c) for c in received.tolist()])
        assert route.slot_tokens == slot_tokens, (route, slot_tokens)
    else:
        # FAN_OUT members are one src DP replica: they all hold these counts.
        route = route_ragged_trusted(plan, rank, [counts] * k)
        if direction is BridgeDirection.FAN_OUT:
            narrow = gather_move(route.slot_tokens, slot).inverse()
            y = adjoint_move(x, narrow, gather_group)
        else:
            y = x.clone(memory_format=torch.contiguous_format)
    # Identity forward; backward all-reduces the gradient over dest CP (before the step).
    y = copy_to_group(y, cp_group)
    return y, torch.tensor(route.dest_counts, dtype=torch.int64)
