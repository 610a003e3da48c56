"""Delivery of encoder rows to the LLM's first pipeline stage: exact bytes, one exchange.

Executes :func:`~mp_bridge.comm.bridge.plans.stage_plan.plan_stage_delivery` (LLM PP > 1) for
``communicate`` (dense rows: one row per sample) and ``communicate_ragged`` (tokens per
sample). One rank's step, on row-major ``x`` ``[rows, *rest]`` of its encoder batch:

=========  ===============================================  ================================
rank       forward                                          backward (gradient rows)
=========  ===============================================  ================================
stage 0    keeps the pieces it holds, receives the others   [CP all-reduce], keeps its own
           (dest batch ``[rows_dest, *rest]``)              pieces' grads, sends the others
later      sends what stage 0 asks; returns ``[0, *rest]``  receives every piece's gradient
=========  ===============================================  ================================

Collectives: forward one ``all_to_all_single`` over the bridge's world group carrying
exactly the rows each first-stage rank consumes and does not hold (nothing to or from a
later stage but its own sends); backward one ``all_to_all_single`` carrying each piece's
gradient once to every holder that did not consume it, so every encoder TP replica ends
with the single-process gradient. Gather flow with dest CP > 1: a consumer all-reduces
the incoming gradient over its CP group first (each CP rank's gradient covers only its own
sequence chunks); later stages hold no image gradient and skip it. Nothing is ever
gathered over the bridge's gather groups.

Ragged: one fixed-size header all-gather (samples, tokens, row numel, element size per
rank; every rank raises the same ``ValueError`` on a mismatch) and, when any piece moves
(FAN_IN), one ``all_to_all_single`` of the moved pieces' per-sample counts before the rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import forbid_double_backward
from mp_bridge.comm.bridge.execution.headers import differing_field, gather_headers, show_field
from mp_bridge.comm.bridge.plans.stage_plan import StageDelivery
from mp_bridge.comm.collectives.primitives import all_reduce_sum, group_size

__all__ = ["StageRows", "deliver_rows", "ragged_dest_counts", "stage_rows"]

Span = tuple[int, int]


@dataclass(frozen=True)
class StageRows:
    """One rank's row ranges (``(start, stop)``) for one delivery; ``[peer]`` maps are by
    global rank, each peer's ranges in piece order (the order of its message).

    ``keep``: ``(x span, y span)`` pieces this rank holds and consumes; ``send``/``recv``:
    forward x spans to a peer, y spans filled from a peer; ``bwd_send``/``bwd_recv``:
    backward y spans to a peer, x spans filled from a peer."""

    x_rows: int
    y_rows: int
    keep: tuple[tuple[Span, Span], ...]
    send: dict[int, tuple[Span, ...]]
    recv: dict[int, tuple[Span, ...]]
    bwd_send: dict[int, tuple[Span, ...]]
    bwd_recv: dict[int, tuple[Span, ...]]


def stage_rows(
    delivery: StageDelivery,
    rank: int,
    src_rows: Sequence[int],
    dest_rows: Sequence[int],
) -> StageRows:
    """``rank``'s :class:`StageRows` from its src batch's rows per sample (``src_rows``)
    and its dest batch's (``dest_rows``; ignored off the first stage). Pure."""
    consumes = delivery.plan.consumes(rank)

    def x_span(piece):
        return delivery.piece_rows(rank, piece, src_rows, side="src")

    def y_span(piece):
        return delivery.piece_rows(rank, piece, dest_rows, side="dest")

    held = set(delivery.src_pieces(rank))
    keep = tuple((x_span(p), y_span(p)) for p in delivery.consumed(rank) if p in held)

    def spans(by_peer, span):
        return {peer: tuple(span(p) for p in pieces) for peer, pieces in by_peer.items()}

    return StageRows(
        x_rows=sum(src_rows),
        y_rows=sum(dest_rows) if consumes else 0,
        keep=keep,
        send=spans(delivery.sends(rank), x_span),
        recv=spans(delivery.receives(rank), y_span),
        bwd_send=spans(delivery.sends(rank, backward=True), y_span),
        bwd_recv=spans(delivery.receives(rank, backward=True), x_span),
    )


def _exchange(
    src: torch.Tensor,
    dst: torch.Tensor,
    send: dict[int, tuple[Span, ...]],
    recv: dict[int, tuple[Span, ...]],
    group: dist.ProcessGroup | None,
    ranks: range,
) -> None:
    """One ``all_to_all_single`` over ``group`` (members ``ranks``, ascending): the rows
    ``send[peer]`` of ``src`` go to each peer, ``recv[peer]`` rows of ``dst`` are filled."""
    if group_size(group) == 1:
        return
    n = len(ranks)
    out_split, in_split = [0] * n, [0] * n
    parts = []
    for peer, spans in sorted(send.items()):
        for a, b in spans:
            parts.append(src[a:b])
            in_split[peer - ranks.start] += b - a
    for peer, spans in recv.items():
        out_split[peer - ranks.start] = sum(b - a for a, b in spans)
    payload = torch.cat(parts) if parts else src[:0]
    got = dst.new_empty((sum(out_split), *dst.shape[1:]))
    dist.all_to_all_single(got, payload.contiguous(), out_split, in_split, group=group)
    at = 0
    for _, spans in sorted(recv.items()):
        for a, b in spans:
            dst[a:b] = got[at : at + b - a]
            at += b - a


class _StageRows(torch.autograd.Function):
    """Forward: own pieces kept, the others received (module table). Backward: [CP
    all-reduce on a consumer], own gradients kept, the others sent to their holders."""

    @staticmethod
    def forward(ctx, x, rows: StageRows, group, ranks: range, cp_group):
        ctx.rows, ctx.group, ctx.ranks, ctx.cp_group = rows, group, ranks, cp_group
        y = x.new_empty((rows.y_rows, *x.shape[1:]))
        for (xa, xb), (ya, yb) in rows.keep:
            y[ya:yb] = x[xa:xb]
        _exchange(x, y, rows.send, rows.recv, group, ranks)
        return y

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward(
            "ColocatedBridgeCommunicator (pipelined LLM)", "its backward exchange runs outside "
            "autograd"
        )  # fmt: skip
        rows = ctx.rows
        if rows.y_rows:  # a consumer: CP shards' partial gradients -> the full one
            grad = all_reduce_sum(grad.contiguous(), ctx.cp_group)
        grad_x = grad.new_zeros((rows.x_rows, *grad.shape[1:]))
        for (xa, xb), (ya, yb) in rows.keep:
            grad_x[xa:xb] = grad[ya:yb]
        _exchange(grad, grad_x, rows.bwd_send, rows.bwd_recv, ctx.group, ctx.ranks)
        return grad_x, None, None, None, None


def deliver_rows(
    x: torch.Tensor,
    rows: StageRows,
    *,
    group: dist.ProcessGroup | None,
    ranks: range,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``x`` ``[x_rows, *rest]`` -> ``[y_rows, *rest]`` (autograd; see the module).
    ``group``: every rank of the grids (``ranks``); ``cp_group``: this rank's dest CP
    group, all-reduced in backward on a consumer (``None``: routed rows, no reduce)."""
    assert x.shape[0] == rows.x_rows, (tuple(x.shape), rows)
    return _StageRows.apply(x, rows, group, ranks, cp_group)


HEADER_FIELDS = ("samples", "tokens", "row numel", "element size")


def ragged_dest_counts(
    x: torch.Tensor,
    counts: Sequence[int],
    delivery: StageDelivery,
    *,
    rank: int,
    group: dist.ProcessGroup | None,
    ranks: range,
) -> list[int]:
    """This rank's dest batch's tokens per sample (``[]`` off the first stage).

    Collectives over ``group``: one header all-gather (``HEADER_FIELDS``, 32 bytes per
    rank), then, when some piece moves, one ``all_to_all_single`` of the moved pieces'
    counts (``8·n`` bytes per piece). Every rank passes the same number of samples and
    row shape, or every rank raises the same ``ValueError``."""
    header = [len(counts), x.shape[0], math.prod(x.shape[1:]), x.element_size()]
    got = gather_headers(header, group, device=x.device)
    field = differing_field(got, {"samples": 0, "row numel": 2, "element size": 3})
    if field is not None:
        per = show_field(ranks, got, HEADER_FIELDS.index(field))
        raise ValueError(
            f"the bridge's ranks passed different {field} to communicate_ragged with a "
            f"pipelined LLM ({per}); every rank's encoder batch must have the same number "
            f"of samples and the same row shape and dtype"
        )
    n, pieces = len(counts), delivery.src_pieces(rank)
    if n % len(pieces):  # n and len(pieces) are the same on every rank: same error
        raise ValueError(
            f"communicate_ragged got {n} samples per encoder batch but the bridge splits it "
            f"into {len(pieces)} equal pieces; use a local batch divisible by {len(pieces)}"
        )
    per = n // len(pieces)
    dest_n = per * len(delivery.dest_pieces(rank)) if delivery.plan.consumes(rank) else 0
    table = torch.tensor(counts, dtype=torch.int64, device=x.device).reshape(-1, 1)
    received = table.new_zeros((dest_n, 1))
    rows = stage_rows(delivery, rank, [1] * n, [1] * dest_n)
    for (xa, xb), (ya, yb) in rows.keep:
        received[ya:yb] = table[xa:xb]
    if delivery.forward:  # the same on every rank: every rank joins the exchange
        _exchange(table, received, rows.send, rows.recv, group, ranks)
    return received.reshape(-1).tolist()
