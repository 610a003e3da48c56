"""Where each held token sits in its sequence, as runs (pure host code, no tensor on device).

A :class:`Run` is a stretch of tokens held contiguously (``offset`` .. ``offset+length``)
whose positions are consecutive (``start`` .. ``start+length``) inside one ``segment`` (a
document's real tokens, or its padding: a query only sees keys of its own segment).
The CP layouts of :class:`~mp_bridge.comm.PaddedLayout` are a few runs per rank: plain
input two (the load-balanced chunks ``i`` and ``2·cp−1−i``), packed input two per
document, plus padding runs. Example, plain ``S = 8``, ``cp = 2``, rank 0 keeps chunks 0
and 3: ``[Run(0, 2, 0, 0), Run(2, 2, 0, 6)]``.

Runs are parsed once per layout and rank (cached on the layout), never read back from a
device tensor; :func:`runs_of_positions` parses user-given positions when no layout is
passed (one host copy per call: pass the adapter's layout to avoid it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mp_bridge.comm import PaddedLayout

__all__ = ["Run", "layout_runs", "natural_order", "runs_of_positions", "shifted"]


@dataclass(frozen=True)
class Run:
    """Tokens ``offset .. offset+length`` (held order) at positions ``start ..`` of
    ``segment``."""

    offset: int
    length: int
    segment: int
    start: int


def _runs(positions: np.ndarray, segments: np.ndarray) -> tuple[Run, ...]:
    """Maximal runs of consecutive positions inside one segment."""
    n = positions.shape[0]
    if n == 0:
        return ()
    cut = np.ones(n, dtype=bool)
    cut[1:] = (np.diff(positions) != 1) | (np.diff(segments) != 0)
    starts = np.flatnonzero(cut)
    ends = np.append(starts[1:], n)
    return tuple(
        Run(int(a), int(b - a), int(segments[a]), int(positions[a])) for a, b in zip(starts, ends)
    )


def _segments_of(layout: PaddedLayout) -> np.ndarray:
    """Segment id of every padded position: ``2·doc`` for real tokens, ``2·doc + 1`` for
    the padding after them (plain input: one document)."""
    seg = np.empty(layout.padded_len, dtype=np.int64)
    if layout.padded_bounds is None:
        seg[: layout.seq_len], seg[layout.seq_len :] = 0, 1
        return seg
    real = layout.bounds
    for i, (a, b) in enumerate(zip(layout.padded_bounds[:-1], layout.padded_bounds[1:])):
        n_real = real[i + 1] - real[i] if i + 1 < len(real) else 0
        seg[a : a + n_real], seg[a + n_real : b] = 2 * i, 2 * i + 1
    return seg


def layout_runs(layout: PaddedLayout, cp_rank: int) -> tuple[Run, ...]:
    """The runs CP rank ``cp_rank`` holds under ``layout`` (its local order), cached."""

    def make() -> tuple[Run, ...]:
        pos = layout.local_positions(cp_rank).numpy()
        return _runs(pos, _segments_of(layout)[pos])

    return layout.cached(("attention_runs", cp_rank), make)


def runs_of_positions(positions: np.ndarray) -> tuple[Run, ...]:
    """Runs of one row of user-given positions (one segment: position order only)."""
    return _runs(positions.astype(np.int64), np.zeros(positions.shape[0], dtype=np.int64))


def shifted(runs: tuple[Run, ...], by: int) -> tuple[Run, ...]:
    """``runs`` held ``by`` tokens later (a rank's block inside a gathered sequence)."""
    return tuple(Run(r.offset + by, r.length, r.segment, r.start) for r in runs)


def natural_order(runs: tuple[Run, ...]) -> tuple[np.ndarray | None, tuple[Run, ...]]:
    """``(index, runs')``: the held tokens reordered by (segment, position), as an index
    for ``index_select`` (``None`` when they are in that order already), and the coalesced
    runs of the reordered tokens."""
    order = sorted(runs, key=lambda r: (r.segment, r.start))
    merged: list[Run] = []
    at = 0
    for r in order:
        last = merged[-1] if merged else None
        if last and last.segment == r.segment and last.start + last.length == r.start:
            merged[-1] = Run(last.offset, last.length + r.length, r.segment, last.start)
        else:
            merged.append(Run(at, r.length, r.segment, r.start))
        at += r.length
    if not order:
        return None, ()
    index = np.concatenate([np.arange(r.offset, r.offset + r.length) for r in order])
    if np.array_equal(index, np.arange(index.shape[0])):
        return None, tuple(merged)
    return index, tuple(merged)
