"""Who sends which batch piece to whom when the LLM runs in pipeline stages: pure.

With LLM PP > 1 (``plan_bridge(..., pipeline=True)``) the encoder still runs on every rank
(src PP = 1) but only the LLM's first stage (``pp == 0``) consumes its outputs. The batch
is cut into **pieces**: the samples one src DP block and one dest DP block share (nesting
makes each piece a whole block of one of them). Piece ``(i, j)`` (src dp ``i``, dest dp
``j``) exists when FAN_IN ``i // k == j``, FAN_OUT ``j // k == i``, EQUAL ``i == j``.

- **holders** of ``(i, j)``: every rank with src dp ``i`` (the encoder TP replicas);
- **consumers**: every first-stage rank with dest dp ``j`` (its TP and CP ranks).

Choices (deterministic, the same on every rank; positions in ascending-rank lists):

- forward: consumer ``q`` keeps the piece if it holds it, else receives it from holder
  number ``pos(q among consumers) mod |holders|``. A later-stage rank receives nothing.
- backward: holder ``e`` keeps its own gradient if it consumed the piece, else receives
  it from consumer number ``pos(e among holders) mod |consumers|``. Every encoder TP
  replica thus ends with the piece's full gradient. (Gather flow with dest CP > 1: the
  consumers first all-reduce the piece gradient over the first stage's CP group, as the
  PP = 1 bridge does; the routed flow sends per-shard rows instead, see ``route``.)

So a first-stage rank receives exactly the pieces it consumes and does not hold, each
once (the byte bound). Example, encoder ``tp=2,dp=4`` -> LLM ``tp=2,pp=2,dp=2`` (FAN_IN
k=2): consumers of piece ``(1, 0)`` are ranks 0 and 1, its holders ranks 2 and 3; rank 0
receives it from rank 2, rank 1 from rank 3; ranks 2 and 3 (stage 1) get its gradient
back from ranks 0 and 1.

Rows: :meth:`StageDelivery.piece_rows` turns per-sample row counts (1 per sample for the
dense bridge, tokens per sample for the ragged one) into a piece's row range inside a
rank's src or dest batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.row_move import MoveLeg, RowMove, span_index
from mp_bridge.table import format_table

__all__ = ["Piece", "StageDelivery", "Transfer", "plan_stage_delivery"]


@dataclass(frozen=True, order=True)
class Piece:
    """The samples shared by src DP block ``src_dp`` and dest DP block ``dest_dp``."""

    src_dp: int
    dest_dp: int

    def __repr__(self) -> str:
        return f"Piece({self.src_dp},{self.dest_dp})"


@dataclass(frozen=True, order=True)
class Transfer:
    """``sender`` sends ``piece`` (rows forward, gradient rows backward) to ``receiver``."""

    piece: Piece
    sender: int
    receiver: int


@dataclass(frozen=True)
class StageDelivery:
    """The point-to-point delivery of encoder outputs to the LLM's first stage.

    ``forward``/``backward``: every transfer, sorted by (piece, sender, receiver); a rank's
    messages to one peer are its pieces in piece order, so sender and receiver agree on
    the layout of a message without exchanging indices.
    """

    plan: BridgePlan
    forward: tuple[Transfer, ...]
    backward: tuple[Transfer, ...]

    # ----------------------------------------------------------------- pieces
    def dest_pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces of ``rank``'s dest (LLM) batch, in batch order (by src dp)."""
        d = self.plan.dest.coords(rank)["dp"]
        return tuple(p for p in _pieces(self.plan) if p.dest_dp == d)

    def src_pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces of ``rank``'s src (encoder) batch, in batch order (by dest dp)."""
        s = self.plan.src.coords(rank)["dp"]
        return tuple(p for p in _pieces(self.plan) if p.src_dp == s)

    def consumed(self, rank: int) -> tuple[Piece, ...]:
        """Pieces ``rank`` feeds to the LLM: its dest pieces on stage 0, else none."""
        return self.dest_pieces(rank) if self.plan.consumes(rank) else ()

    def piece_rows(
        self, rank: int, piece: Piece, rows_per_sample: Sequence[int], *, side: str
    ) -> tuple[int, int]:
        """``(start, stop)`` rows of ``piece`` in ``rank``'s ``side`` (``"src"``/``"dest"``)
        batch, whose samples have ``rows_per_sample`` rows (all of that batch's samples).

        Pieces split a batch into equal sample counts. E.g. FAN_IN k=2, a dest batch of
        per-sample tokens ``(3, 0, 2, 5)``: piece of src slot 1 is rows ``(3, 10)``.
        """
        pieces = {"src": self.src_pieces, "dest": self.dest_pieces}[side](rank)
        if piece not in pieces:
            raise ValueError(f"{piece!r} is not in rank {rank}'s {side} batch {list(pieces)}")
        n = len(rows_per_sample)
        if n % len(pieces):
            raise ValueError(
                f"rows_per_sample has {n} samples but rank {rank}'s {side} batch holds "
                f"{len(pieces)} equal pieces; use a local batch divisible by {len(pieces)}"
            )
        per, at = n // len(pieces), pieces.index(piece)
        start = sum(rows_per_sample[: at * per])
        return start, start + sum(rows_per_sample[at * per : (at + 1) * per])

    def row_move(
        self,
        rank: int,
        src_rows: Sequence[int],
        dest_rows: Sequence[int],
        *,
        exchange: bool = True,
    ) -> RowMove:
        """``rank``'s :class:`RowMove` over every rank of the grids (group order = rank
        order), from its src batch's rows per sample (``src_rows``) and its dest batch's
        (``dest_rows``; ignored off the first stage). Forward: the pieces it holds and
        consumes are kept, the others received; backward: its own pieces' gradients kept,
        the others sent to their holders. ``exchange``: whether the forward leg runs its
        collective (the backward's always does)."""
        consumes = self.plan.consumes(rank)
        ranks = self.plan.src.ranks

        def x_span(piece):
            return self.piece_rows(rank, piece, src_rows, side="src")

        def y_span(piece):
            return self.piece_rows(rank, piece, dest_rows, side="dest")

        held = set(self.src_pieces(rank))
        keep = [(x_span(p), y_span(p)) for p in self.consumed(rank) if p in held]
        keep_x, keep_y = span_index([k[0] for k in keep]), span_index([k[1] for k in keep])

        def per_member(by_peer, span):
            spans = {peer: [span(p) for p in pieces] for peer, pieces in by_peer.items()}
            return tuple(span_index(spans.get(m, ())) for m in ranks)

        x_rows, y_rows = sum(src_rows), sum(dest_rows) if consumes else 0
        forward = MoveLeg(x_rows, y_rows, keep_x, keep_y, per_member(self.sends(rank), x_span),
                          per_member(self.receives(rank), y_span), exchange)  # fmt: skip
        backward = MoveLeg(
            y_rows, x_rows, keep_y, keep_x,
            per_member(self.sends(rank, backward=True), y_span),
            per_member(self.receives(rank, backward=True), x_span), True,
        )  # fmt: skip
        return RowMove(forward, backward)

    # -------------------------------------------------------------- messages
    def sends(self, rank: int, *, backward: bool = False) -> dict[int, tuple[Piece, ...]]:
        """``{receiver: pieces}`` that ``rank`` sends (forward rows or backward grads)."""
        return _by_peer(self.backward if backward else self.forward, rank, send=True)

    def receives(self, rank: int, *, backward: bool = False) -> dict[int, tuple[Piece, ...]]:
        """``{sender: pieces}`` that ``rank`` receives."""
        return _by_peer(self.backward if backward else self.forward, rank, send=False)

    def describe(self) -> str:
        """Per rank: its LLM stage, what it consumes, and whom it sends to / receives from."""
        plan = self.plan
        head = (
            f"llm pp {plan.pp_size}: stage 0 consumes encoder rows; later stages send their "
            f"encoder rows and receive none\n"
        )
        rows = [("rank", "stage", "consumes", "fwd sends", "fwd recvs", "bwd recvs")]
        for r in plan.src.ranks:
            rows.append(
                (
                    str(r),
                    str(plan.stage_of(r)),
                    _fmt_pieces(self.consumed(r)) or "-",
                    _fmt_peers(self.sends(r)),
                    _fmt_peers(self.receives(r)),
                    _fmt_peers(self.receives(r, backward=True)),
                )
            )
        return head + format_table(rows)


def _pieces(plan: BridgePlan) -> list[Piece]:
    dps, dpd, k = plan.src.axis_size("dp"), plan.dest.axis_size("dp"), plan.scale
    if plan.direction is BridgeDirection.FAN_IN:
        return [Piece(i, i // k) for i in range(dps)]
    if plan.direction is BridgeDirection.FAN_OUT:
        return [Piece(j // k, j) for j in range(dpd)]
    return [Piece(i, i) for i in range(dps)]


def _by_peer(transfers, rank: int, *, send: bool) -> dict[int, tuple[Piece, ...]]:
    out: dict[int, list[Piece]] = {}
    for t in transfers:
        me, peer = (t.sender, t.receiver) if send else (t.receiver, t.sender)
        if me == rank:
            out.setdefault(peer, []).append(t.piece)
    return {peer: tuple(sorted(p)) for peer, p in sorted(out.items())}


def _fmt_pieces(pieces) -> str:
    return " ".join(f"({p.src_dp},{p.dest_dp})" for p in pieces)


def _fmt_peers(by_peer: dict[int, tuple[Piece, ...]]) -> str:
    return "; ".join(f"{peer}:{_fmt_pieces(p)}" for peer, p in by_peer.items()) or "-"


def plan_stage_delivery(plan: BridgePlan) -> StageDelivery:
    """The :class:`StageDelivery` of ``plan`` (any dest PP; at PP = 1 every rank consumes).

    Pure: computed from the two layouts, identical on every rank.
    """
    if not isinstance(plan, BridgePlan):
        raise TypeError(f"plan must be a BridgePlan (from plan_bridge), got {type(plan).__name__}")
    src, dest = plan.src, plan.dest
    holders: dict[int, list[int]] = {}
    consumers: dict[int, list[int]] = {}
    for r in src.ranks:
        holders.setdefault(src.coords(r)["dp"], []).append(r)
        if plan.consumes(r):
            consumers.setdefault(dest.coords(r)["dp"], []).append(r)
    fwd, bwd = [], []
    for piece in _pieces(plan):
        hold, cons = holders[piece.src_dp], consumers[piece.dest_dp]
        for pos, q in enumerate(cons):
            if q not in hold:
                fwd.append(Transfer(piece, hold[pos % len(hold)], q))
        for pos, e in enumerate(hold):
            if e not in cons:
                bwd.append(Transfer(piece, cons[pos % len(cons)], e))
    return StageDelivery(plan, tuple(sorted(fwd)), tuple(sorted(bwd)))
