"""Which rows go where, forward and backward: the one plan type every row move runs by.

Route, stage (PP delivery), the image balancer and ragged each move rows between the
members of a group by a plan and move them back in backward. Their plans
(:class:`~.route.RankRoute`, :class:`~.stage.StageDelivery`,
:class:`~.balance_plan.BalancePlan`, the ragged gather) each produce one rank's
:class:`RowMove`, and one execution
(:mod:`~mp_bridge.comm.bridge.execution.row_move`) runs any of them: a
:class:`MoveLeg` is one direction (``dst[keep_dst] = src[keep_src]``; ``src[send[m]]`` to
member ``m``; ``dst[recv[m]]`` filled from ``m``'s message, in message order, one
``all_to_all_single`` when ``exchange``), a :class:`RowMove` its forward and backward.

- route and stage: ``backward`` sends each gradient row to every holder, which is not
  ``forward``'s adjoint (their execution refuses double backward);
- the balancer: ``backward`` is ``forward.reversed()`` (a permutation of rows across
  ranks: its adjoint is the inverse move), so :meth:`RowMove.inverse` is the adjoint;
- ragged: :func:`gather_move` (every member's slot) and its inverse, the narrow to this
  rank's slot, are each other's adjoint on a group-replicated gradient.

Example, :func:`gather_move` ``((2, 1), slot=1)``: forward ``keep_src [0]``,
``keep_dst [2]``, ``send (tensor([0]), tensor([]))``, ``recv (tensor([0, 1]),
tensor([]))``; backward keeps ``dst`` rows ``[2]`` only (no exchange).

Pure (``tests/unit/test_architecture.py``): LongTensor indices on the CPU, no process group.
``exchange`` is decided from facts every member shares, never from this rank's empty
messages, so every member joins the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MoveLeg", "RowMove", "gather_move", "span_index"]


@dataclass(frozen=True)
class MoveLeg:
    """One direction of a move on one rank (``[m]``: per group member, group order).

    ``src_rows``/``dst_rows``: rows in and out; ``keep_src``/``keep_dst``: rows copied
    locally; ``send[m]``: ``src`` rows sent to ``m`` (message order); ``recv[m]``: ``dst``
    rows filled from ``m``'s message; ``exchange``: whether the collective runs (the
    same on every member)."""

    src_rows: int
    dst_rows: int
    keep_src: torch.Tensor
    keep_dst: torch.Tensor
    send: tuple[torch.Tensor, ...]
    recv: tuple[torch.Tensor, ...]
    exchange: bool

    def reversed(self) -> MoveLeg:
        """The inverse leg (``dst`` rows back to where they came from)."""
        return MoveLeg(self.dst_rows, self.src_rows, self.keep_dst, self.keep_src,
                       self.recv, self.send, self.exchange)  # fmt: skip

    def send_counts(self) -> list[int]:
        return [len(s) for s in self.send]

    def recv_counts(self) -> list[int]:
        return [len(r) for r in self.recv]

    def covers(self) -> bool:
        """Whether every ``dst`` row is written (else the rest stay zero)."""
        return len(self.keep_dst) + sum(self.recv_counts()) == self.dst_rows


@dataclass(frozen=True)
class RowMove:
    """One rank's rows forward and (gradient rows) backward."""

    forward: MoveLeg
    backward: MoveLeg

    def inverse(self) -> RowMove:
        """The move whose forward is this one's backward (and back): for the balancer and
        ragged, the adjoint."""
        return RowMove(self.backward, self.forward)


def span_index(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """LongTensor of the rows of ``spans`` (``(start, stop)``), in order."""
    parts = [torch.arange(a, b, dtype=torch.long) for a, b in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def gather_move(slot_rows: Sequence[int], slot: int) -> RowMove:
    """Forward: this member's ``slot_rows[slot]`` rows to every member, every member's rows
    received in slot order (``[sum(slot_rows), *rest]``). Backward: keep this member's
    slot of the (group-replicated) gradient, no exchange; :meth:`RowMove.inverse` is
    the narrow whose backward is the gather."""
    starts = [sum(slot_rows[:m]) for m in range(len(slot_rows) + 1)]
    own = torch.arange(slot_rows[slot], dtype=torch.long)
    mine = torch.arange(starts[slot], starts[slot + 1], dtype=torch.long)
    empty = own[:0]
    send = tuple(empty if m == slot else own for m in range(len(slot_rows)))
    recv = tuple(
        empty if m == slot else torch.arange(starts[m], starts[m + 1], dtype=torch.long)
        for m in range(len(slot_rows))
    )
    gather = MoveLeg(slot_rows[slot], starts[-1], own, mine, send, recv, exchange=True)
    nothing = tuple(empty for _ in slot_rows)
    narrow = MoveLeg(starts[-1], slot_rows[slot], mine, own, nothing, nothing, exchange=False)
    return RowMove(gather, narrow)
