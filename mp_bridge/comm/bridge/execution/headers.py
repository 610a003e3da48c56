"""Fixed-size int64 headers: one all-gather, the same rows on every rank, the same error.

Four bridge steps open with a header of a fixed number of int64 per rank, so that a rank
passing a wrong batch (another number of samples, row shape or dtype) cannot break the
collective that checks it: ragged FAN_IN (``ragged.py``: samples, tokens, row numel, row
code), ragged into a pipelined LLM (``stage.py``: samples, tokens, row numel, element
size), the image balancer's count rows (``balancer.py``) and ``route``'s per-sample count
rows (``sample_counts.py``). :func:`gather_headers` is their one all-gather; every rank
then holds every member's row, so the comparisons that follow (:func:`differing_field`,
or the step's own) reach the same verdict on every rank, and every rank raises the same
``ValueError`` instead of one rank hanging in the next collective.

Bytes: ``8·len(row)`` per member, one ``all_gather`` (nothing for a single process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from mp_bridge.comm.collectives.primitives import all_gather_tensor, group_size

__all__ = ["differing_field", "gather_headers", "show_field"]


def gather_headers(
    row: Sequence[int], group: dist.ProcessGroup | None, *, device: torch.device | str
) -> list[list[int]]:
    """Every member's ``row`` (the same length on every member), in group rank order.

    One ``all_gather`` of ``len(row)`` int64 on ``device`` per member; ``[list(row)]``
    for a single process (``group`` ``None`` or of size 1), with no collective.
    """
    if group_size(group) == 1:
        return [[int(v) for v in row]]
    local = torch.tensor(list(row), dtype=torch.int64, device=device)
    return all_gather_tensor(local, group, 0).reshape(-1, len(row)).cpu().tolist()


def differing_field(rows: Sequence[Sequence[int]], fields: Mapping[str, int]) -> str | None:
    """The first name of ``fields`` (name -> index in a row) whose entries differ between
    ``rows``, else ``None``. The same answer on every rank that holds the same rows."""
    for name, i in fields.items():
        if len({r[i] for r in rows}) > 1:
            return name
    return None


def show_field(
    ranks: Sequence[int],
    rows: Sequence[Sequence[int]],
    index: int,
    fmt: Callable[[int], str] = str,
) -> str:
    """``"rank 0: 3, rank 2: 4"``: entry ``index`` of each member's row, for a message."""
    return ", ".join(f"rank {r}: {fmt(h[index])}" for r, h in zip(ranks, rows))
