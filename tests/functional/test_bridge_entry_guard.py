"""One entry guard and one agreement per public call of the communicator (4 ranks).

Each public call (``communicate``, ``communicate_ragged``, ``route``) checks liveness and
membership once (``BridgePlan.check_member`` counted) and runs one agreement mechanism:
``agree`` once for the dense call, the ragged FAN_OUT/EQUAL calls and ``route`` (whose
fixed-size count row carries the per-sample counts the plan needs), and none for ragged
FAN_IN, whose header all-gather is its agreement (the token exchange behind it is not
checked again). A row dtype that differs across a FAN_IN gather group at equal element
size (bf16 vs fp16) is caught by that header on every member.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mp_bridge.comm.bridge.execution.communicator as communicator_module
import mp_bridge.comm.bridge.execution.ragged as ragged_module
from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.testing import DistributedWorld
from tests.functional.ragged_oracle import H, grids

world = DistributedWorld(4)


class _Counts:
    """Counts ``BridgePlan.check_member`` and every ``agree`` of the bridge's execution."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.members, self.agrees = 0, 0
        check, agree = BridgePlan.check_member, communicator_module.agree

        def counting_check(plan, rank, call):
            self.members += 1
            return check(plan, rank, call)

        def counting_agree(*args, **kwargs):
            self.agrees += 1
            return agree(*args, **kwargs)

        monkeypatch.setattr(BridgePlan, "check_member", counting_check)
        monkeypatch.setattr(communicator_module, "agree", counting_agree)
        monkeypatch.setattr(ragged_module, "agree", counting_agree)

    def take(self) -> tuple[int, int]:
        out, (self.members, self.agrees) = (self.members, self.agrees), (0, 0)
        return out


@world.case
def test_each_public_call_guards_once_and_agrees_once():
    monkeypatch = pytest.MonkeyPatch()
    try:
        # FAN_IN k = 2 (encoder tp 2, dp 2 -> LLM tp 2, cp 2): gather groups (0, 2), (1, 3).
        fan_in = grids(dict(tp=2, dp=2), dict(tp=2, cp=2))
        with ColocatedBridgeCommunicator(*fan_in) as bridge:
            bridge.prepare_route()
            counts = _Counts(monkeypatch)
            bridge.communicate(torch.randn(2, 4, H))
            assert counts.take() == (1, 1)
            bridge.communicate_ragged(torch.randn(3, H), [1, 2])
            assert counts.take() == (1, 0)  # the header is the agreement
            cp = fan_in[1].get_pg("cp")
            part = PartitionAdapter(cp_group=cp)
            mask = torch.zeros(2, 4, dtype=torch.bool)
            mask[:, 1] = True
            bridge.route(torch.randn(1, H), tokens_per_sample=[1], image_mask=mask, partition=part)
            assert counts.take() == (1, 1)
            monkeypatch.undo()
        # FAN_OUT k = 2 (encoder tp 2, dp 2 -> LLM dp 4): one agree, no header.
        with ColocatedBridgeCommunicator(*grids(dict(tp=2, dp=2), dict(dp=4))) as bridge:
            counts = _Counts(monkeypatch)
            bridge.communicate_ragged(torch.randn(3, H), [1, 2])
            assert counts.take() == (1, 1)
    finally:
        monkeypatch.undo()
    dist.barrier()


@world.case
def test_fan_in_header_catches_a_dtype_of_the_same_size():
    rank = dist.get_rank()
    dtype = torch.float16 if rank == 2 else torch.bfloat16
    with ColocatedBridgeCommunicator(*grids(dict(tp=2, dp=2), dict(tp=2, cp=2))) as bridge:
        x = torch.randn(3, H).to(dtype)
        if rank in (0, 2):  # gather group (0, 2): rank 2 passes fp16, rank 0 bf16
            with pytest.raises(ValueError, match=r"tokens of different row shapes or dtypes"):
                bridge.communicate_ragged(x, [1, 2])
        else:
            assert bridge.communicate_ragged(x, [1, 2])[0].shape == (6, H)
        dist.barrier()
