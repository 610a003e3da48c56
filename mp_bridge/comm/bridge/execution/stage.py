"""Delivery of encoder rows to the LLM's first pipeline stage: exact bytes, one exchange.

Executes :func:`~mp_bridge.comm.bridge.plans.stage.plan_stage_delivery` (LLM PP > 1) for
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

Each rank's rows are a :class:`~mp_bridge.comm.bridge.plans.row_move.RowMove`
(:meth:`StageDelivery.row_move`), run by :mod:`~mp_bridge.comm.bridge.execution.row_move`
(``one_way_move``: double backward refused).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_bridge.comm.bridge.execution.headers import differing_field, gather_headers, show_field
from mp_bridge.comm.bridge.execution.row_move import one_way_move, run_leg
from mp_bridge.comm.bridge.plans.row_move import RowMove
from mp_bridge.comm.bridge.plans.stage import StageDelivery

__all__ = ["deliver_rows", "ragged_dest_counts"]


def deliver_rows(
    x: torch.Tensor,
    move: RowMove,
    *,
    group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """``x`` ``[x_rows, *rest]`` -> ``[y_rows, *rest]`` by ``move``
    (:meth:`StageDelivery.row_move`; autograd, see the module). ``group``: every rank of
    the grids; ``cp_group``: this rank's dest CP group, all-reduced in backward on a
    consumer."""
    consumer = move.forward.dst_rows > 0  # CP shards' partial gradients -> the full one
    return one_way_move(
        x, move, group, cp_group=cp_group if consumer else None,
        where="ColocatedBridgeCommunicator (pipelined LLM)",
        why="its backward exchange runs outside autograd",
    )  # fmt: skip


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
    # delivery.forward is the same on every rank: every rank joins the exchange or none
    move = delivery.row_move(rank, [1] * n, [1] * dest_n, exchange=bool(delivery.forward))
    return run_leg(table, move.forward, group).reshape(-1).tolist()
