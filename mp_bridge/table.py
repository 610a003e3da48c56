"""The one plain-text table formatter of mp_bridge (``plan``/``demo`` output, plan tables)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, a dashed rule under the header (``rows[0]``)::

        rank  encoder
        ----  ---------
        0     tp=0,dp=0

    Every row must have as many cells as the header; trailing spaces are stripped.
    """
    if not rows:
        raise ValueError("rows is empty; pass at least the header row")
    n = len(rows[0])
    bad = [i for i, row in enumerate(rows) if len(row) != n]
    if bad:
        raise ValueError(f"rows {bad} do not have {n} cells like the header {list(rows[0])}")
    widths = [max(len(row[i]) for row in rows) for i in range(n)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
