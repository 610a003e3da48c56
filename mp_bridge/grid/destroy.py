"""Free every process group a megatron ``HyperCommGrid`` created.

megatron-core >= 0.17 has ``HyperCommGrid.destroy()``, which is used when present
(``megatron_compat.grid_destroy``). On 0.16 (no such method) the groups are read from the
private dict ``grid._pgs`` (key -> this rank's group, or ``None`` on ranks outside the
grid); this is the one place in mp_bridge that reads it. Typical use, after the models
built on a grid are released::

    grid = make_grid(tp=2, dp=4, create=("tp", "dp"))
    ...
    destroy_grid(grid)  # on every rank, like the group creation
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mp_bridge.grid.megatron_compat import grid_destroy

__all__ = ["destroy_grid"]


def destroy_grid(grid: Any) -> None:
    """Destroy every process group ``grid`` created and forget them (idempotent).

    Collective like the creation: every rank of the world calls it, in the same order as
    its other group creations and destructions. Afterwards ``grid.get_pg`` raises
    ``KeyError`` and ``grid.create_pg`` may build the groups again.
    """
    pgs = getattr(grid, "_pgs", None)
    if not isinstance(pgs, dict):
        raise TypeError(
            f"grid={grid!r} is not a megatron HyperCommGrid (no _pgs dict of groups); pass "
            "the grid make_grid or HyperCommGrid(...) returned"
        )
    if pgs:
        # Every rank must have finished connecting its groups before any rank frees them
        # (gloo handshakes complete asynchronously; see ColocatedBridgeCommunicator).
        dist.barrier()
    own_destroy = grid_destroy(grid)
    if own_destroy is not None:  # megatron-core >= 0.17
        own_destroy()
        pgs.clear()  # a no-op for megatron's own destroy(); keeps the contract for any grid
        return
    for pg in list(pgs.values()):
        if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(pg)
    pgs.clear()
