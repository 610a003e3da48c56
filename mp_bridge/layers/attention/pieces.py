"""Which (query rows, key rows) pairs a set of runs needs, and how (pure host code).

A :class:`BlockPair` is one kernel call: query rows ``q0:q1`` against key rows ``k0:k1`` of
the tokens in hand, ``FULL`` (every key visible to every query), ``CAUSAL`` (a square
pair starting at the same position: key ``j`` visible to query ``i`` iff ``j <= i``) or
``MASKED`` (a float mask from the positions, for user positions that form no runs).
Pairs of runs in different segments, or wholly in a query's future, produce no piece and
so no kernel launch.

Causal split of query run ``[a, a+lq)`` against key run ``[c, c+lk)`` of one segment
(positions): keys ``[c, min(c+lk, a))`` are before every query (``FULL``, all rows); from
``c0 = max(a, c)`` to ``e = min(c+lk, a+lq)`` the pair is square (``CAUSAL``, rows and
keys ``[c0, e)``); rows ``[e, a+lq)`` see keys ``[c0, e)`` entirely (``FULL``). Example:
one process, ``S = 8``: one ``CAUSAL`` piece ``(0, 8, 0, 8)``; CP 2 rank 0's chunk
``[6, 8)`` over the natural-order keys ``[0, 8)``: ``FULL (.., 0:6)`` and ``CAUSAL``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mp_bridge.layers.attention.runs import Run

__all__ = ["CAUSAL", "FULL", "MASKED", "BlockPair", "covered_once", "masked_pieces", "run_pieces"]

FULL, CAUSAL, MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class BlockPair:
    """One kernel call: query rows ``q0:q1`` x key rows ``k0:k1``, of ``kind``."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


def _causal_pieces(q: Run, k: Run) -> list[BlockPair]:
    a, lq, c, lk = q.start, q.length, k.start, k.length
    out = []
    before = min(c + lk, a) - c
    if before > 0:
        out.append(BlockPair(q.offset, q.offset + lq, k.offset, k.offset + before, FULL))
    c0, e = max(a, c), min(c + lk, a + lq)
    if c0 < e:
        kq, kk = q.offset + (c0 - a), k.offset + (c0 - c)
        out.append(BlockPair(kq, kq + (e - c0), kk, kk + (e - c0), CAUSAL))
        if e < a + lq:
            out.append(BlockPair(q.offset + (e - a), q.offset + lq, kk, kk + (e - c0), FULL))
    return out


def run_pieces(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], causal: bool) -> list[BlockPair]:
    """The pieces of every same-segment (query run, key run) pair."""
    pieces: list[BlockPair] = []
    for q in q_runs:
        for k in k_runs:
            if q.segment != k.segment:
                continue
            if causal:
                pieces.extend(_causal_pieces(q, k))
            else:
                pieces.append(
                    BlockPair(q.offset, q.offset + q.length, k.offset, k.offset + k.length, FULL)
                )
    return pieces


def covered_once(pieces: list[BlockPair], s_q: int, s_k: int) -> tuple[bool, bool]:
    """Whether every query row, and every key row, is in at most one pair: then nothing is
    ever merged or summed there, and the buffers may stay in the input dtype (packed
    documents in one process: one diagonal pair each)."""
    rows, keys = np.zeros(s_q, dtype=np.int64), np.zeros(s_k, dtype=np.int64)
    for p in pieces:
        rows[p.q0 : p.q1] += 1
        keys[p.k0 : p.k1] += 1
    return bool(rows.max(initial=0) <= 1), bool(keys.max(initial=0) <= 1)


def masked_pieces(s_q: int, s_k: int, block: int, k_base: int = 0) -> list[BlockPair]:
    """Every (query block, key block) pair of ``block`` tokens, masked from positions."""
    return [
        BlockPair(i, min(i + block, s_q), k_base + j, k_base + min(j + block, s_k), MASKED)
        for i in range(0, s_q, block)
        for j in range(0, s_k, block)
    ]
