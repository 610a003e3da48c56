"""TP groups of consecutive ranks carved out of one test world (vocab-layer test helper).

``tp_group(tp)`` returns this rank's group for TP size ``tp`` (``None`` for TP = 1) and
whether this rank is in one: ranks ``[0, tp), [tp, 2 tp), ...`` form the groups, so with
TP = 3 on 8 ranks, ranks 6 and 7 sit out. Every rank creates every group, in the same
order (``dist.new_group`` is collective over the world).
"""

from __future__ import annotations

import torch.distributed as dist

_GROUPS: dict[int, tuple[dist.ProcessGroup | None, bool]] = {}


def tp_group(tp: int) -> tuple[dist.ProcessGroup | None, bool]:
    """(this rank's TP group, whether it is in one)."""
    if tp == 1:
        return None, True
    if tp not in _GROUPS:
        rank, mine = dist.get_rank(), None
        for start in range(0, dist.get_world_size() - tp + 1, tp):
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        _GROUPS[tp] = (mine, mine is not None)
    return _GROUPS[tp]


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)
