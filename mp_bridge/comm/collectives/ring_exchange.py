"""One step of a ring: send a tensor to the next rank of a group, receive the previous one's.

Used by ring attention (``context_parallel_attention(comm="ring")``): ``start`` posts the
``irecv`` from ``rank − 1`` and the ``isend`` to ``rank + 1`` and returns at once, so the
caller computes on the block in hand while the next one travels; ``wait`` returns the
received tensor. Group ranks are mapped to global ranks once here. Not an autograd
Function: the ring's backward circulates its own tensors (see the attention's docstring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm.collectives.primitives import group_rank, group_size

__all__ = ["RingStep", "ring_neighbours"]


def ring_neighbours(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Global ranks ``(previous, next)`` of this rank in ``group``'s ring."""
    n, r = group_size(group), group_rank(group)
    return (
        dist.get_global_rank(group, (r - 1) % n),
        dist.get_global_rank(group, (r + 1) % n),
    )


class RingStep:
    """``RingStep(x, into, group)``: ``x`` on its way to the next rank, ``into`` (same shape
    and dtype) filling from the previous one; ``wait()`` returns ``into``."""

    def __init__(self, x: torch.Tensor, into: torch.Tensor, group: dist.ProcessGroup | None):
        prev, nxt = ring_neighbours(group)
        self.into = into
        self.works = [
            dist.irecv(into, src=prev, group=group),
            dist.isend(x.contiguous(), dst=nxt, group=group),
        ]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.into
