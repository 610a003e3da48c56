"""``CollectiveCounter`` around point-to-point ops built as ``P2POp(dist.isend, ...)``
(torch's pipeline schedules do this): torch checks ``op is isend`` against its own
module's function, so the counter must keep those checks true, count each op once, and
restore every patched function on exit. Oracle: the tensor sizes sent (exact bytes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device

world = DistributedWorld(2, timeout_s=120)


@world.case
def test_p2pop_isend_irecv_are_counted_and_restored():
    rank = dist.get_rank()
    originals = (dist.isend, dist.irecv, c10d.isend, c10d.irecv)
    buf = torch.full((3, 5), float(rank), device=current_device())
    with CollectiveCounter() as counter:
        if rank == 0:
            ops = [dist.P2POp(dist.isend, buf, 1)]
        else:
            ops = [dist.P2POp(dist.irecv, buf, 0)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    assert (dist.isend, dist.irecv, c10d.isend, c10d.irecv) == originals
    assert counter.counts() == ({"send": 1} if rank == 0 else {"recv": 1}), counter.calls
    assert counter.bytes_received() == 3 * 5 * 4
    if rank == 1:
        assert torch.equal(buf, torch.zeros(3, 5, device=buf.device))
