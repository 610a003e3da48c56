"""``check_sample_counts``: every rank of the bridge compares the per-sample counts.

Runs the steps of :mod:`~mp_bridge.comm.bridge.plans.count_rows` over the bridge's world
group: one fixed-size all-gather of :class:`CountRow` s, then (only on a mismatch) one
``all_gather_object`` of the counts so that every rank raises the same ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple

import torch
import torch.distributed as dist

from mp_bridge.comm.bridge.execution.headers import gather_headers
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.count_rows import (
    CountRow,
    count_mismatch_message,
    count_row,
    counts_agree,
)
from mp_bridge.comm.collectives.primitives import group_size

__all__ = ["check_sample_counts"]


def check_sample_counts(
    plan: BridgePlan,
    rank: int,
    world_group: dist.ProcessGroup | None,
    *,
    encoder_counts: Sequence[int],
    llm_counts: Sequence[int],
    device: torch.device | str = "cpu",
    where: str = "ColocatedBridgeCommunicator.route",
) -> tuple[CountRow, ...]:
    """Raise the same ``ValueError`` on every rank of ``world_group`` unless the counts fit.

    ``encoder_counts``: this rank's ``tokens_per_sample`` (its encoder DP batch);
    ``llm_counts``: the image positions of each sample of its LLM DP batch. ``world_group``
    spans every rank of ``plan``'s grids (``None``: a single process). Collectives: one
    all-gather of ``[1, ROW_SIZE]`` int64 on ``device``; on a mismatch one
    ``all_gather_object``. Returns every rank's :class:`CountRow` (group order), checked.
    """
    row = count_row(rank, encoder_counts, llm_counts)
    rows = tuple(CountRow(*r) for r in gather_headers(astuple(row), world_group, device=device))
    if counts_agree(plan, rows):
        return rows
    mine = (rank, tuple(encoder_counts), tuple(llm_counts))
    if group_size(world_group) > 1:
        parts: list = [None] * group_size(world_group)
        dist.all_gather_object(parts, mine, group=world_group)
    else:
        parts = [mine]
    raise ValueError(count_mismatch_message(plan, {r: (e, m) for r, e, m in parts}, where))
