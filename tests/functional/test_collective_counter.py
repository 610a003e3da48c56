"""``CollectiveCounter`` around point-to-point ops built as ``P2POp(dist.isend, ...)``
(torch's pipeline schedules do this): torch checks ``op is isend`` against its own
module's function, so the counter must keep those checks true, count each op once, and
restore every patched function on exit. Oracle: the tensor sizes sent (exact bytes).
DTensor's functional collectives (FSDP2 weights) are counted too, once each."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

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


@world.case
def test_dtensor_functional_collectives_are_counted_once():
    """DTensor issues functional collectives (``_c10d_functional``), which the
    ``dist.<name>`` wrappers never see: the counter before this fix read ``{}`` here.
    The trap it must catch is TRL #6077's: a chunked loss that re-gathers an FSDP2 weight
    once per vocab chunk. Oracles: torch's ``CommDebugMode`` counts the same ops, and the
    bytes are the other rank's rows (FSDP2 gives rank r rows ``[4r, 4r + 4)`` of ``[8, 4]``).
    """
    dev = current_device()
    torch.manual_seed(0)  # same weight on both ranks before sharding
    lin = nn.Linear(4, 8, bias=False, device=dev)
    full = lin.weight.detach().clone()
    fully_shard(lin, mesh=init_device_mesh(dev.type, (2,)))
    with CollectiveCounter() as counter, CommDebugMode() as torch_mode:
        chunks = [lin.weight.full_tensor()[i : i + 2] for i in range(0, 8, 2)]
    assert torch.equal(torch.cat(chunks), full)
    assert counter.counts() == {"all_gather": 4}, counter.calls
    assert torch_mode.get_total_counts() == 4
    assert counter.bytes_received() == 4 * (4 * 4 * 4)  # 4 gathers x the other 4x4 fp32 rows
    # FSDP2's own eager collectives (``dist.all_gather_single``) still count once each:
    # the root unit keeps its weight after forward, so one all-gather and one reduce-scatter.
    with CollectiveCounter() as counter, CommDebugMode() as torch_mode:
        lin(torch.ones(3, 4, device=dev)).sum().backward()
    assert counter.counts() == {"all_gather": 1, "reduce_scatter": 1}, counter.calls
    assert torch_mode.get_total_counts() == 2
