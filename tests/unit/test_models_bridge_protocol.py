"""The bridge protocol and the flow as the models' only dispatch (no process group).

Both bridges satisfy :class:`~mp_bridge.comm.Bridge`; the one-process bridge takes
``balance=`` like the communicator; a user's object of the deprecated form becomes a
one-process :class:`StandInBridge`; a flow without a per-microbatch delivery is refused
with a pipelined LLM before anything runs; and no module of ``mp_bridge/models`` switches
on a flow's name or probes the bridge's type.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from mp_bridge.comm import (
    Bridge,
    ColocatedBridgeCommunicator,
    LocalBridge,
    PartitionAdapter,
    plan_balance,
)
from mp_bridge.models import MimoFlow, MimoGroups
from mp_bridge.models.colocated import mimo_groups
from mp_bridge.models.colocated.pipelined import pipelined_step

MODELS = Path(__file__).resolve().parents[2] / "mp_bridge" / "models"


def test_local_bridge_is_a_bridge_with_no_plan():
    bridge = LocalBridge()
    assert isinstance(bridge, Bridge)
    assert (bridge.plan, bridge.world_group, bridge.src_grid, bridge.dest_grid) == (None,) * 4
    assert MimoGroups.local().bridge.plan is None


def test_the_communicator_has_every_member_of_the_protocol():
    # An instance needs a process group; the class must define every protocol member
    # (grids are set in __init__) with route's keywords, balance= included.
    members = {"plan", "world_group", "communicate", "communicate_ragged", "route", "destroy"}
    assert all(hasattr(ColocatedBridgeCommunicator, m) for m in members)
    for bridge in (ColocatedBridgeCommunicator, LocalBridge):
        params = inspect.signature(bridge.route).parameters
        assert list(params)[1:] == list(inspect.signature(Bridge.route).parameters)[1:]


def test_local_bridge_route_takes_a_one_replica_balance_plan():
    x = torch.randn(3, 4)
    mask = torch.tensor([[True, False, True, True]])
    one = plan_balance([[2, 1]])
    out = LocalBridge().route(
        x, tokens_per_sample=torch.tensor([3]), image_mask=mask, partition=PartitionAdapter(),
        balance=one,
    )  # fmt: skip
    assert out is x
    two = plan_balance([[2], [1]])
    with pytest.raises(ValueError, match="one process is one encoder replica"):
        LocalBridge().route(
            x, tokens_per_sample=torch.tensor([3]), image_mask=mask,
            partition=PartitionAdapter(), balance=two,
        )  # fmt: skip


class _OnlyCommunicate:
    def communicate(self, x):
        return x + 1

    def destroy(self):
        pass


def test_a_users_object_becomes_a_deprecated_one_process_stand_in():
    inner = _OnlyCommunicate()
    with pytest.warns(DeprecationWarning, match=r"not a Bridge.*removed in mp_bridge 0\.3\.0"):
        groups = MimoGroups(None, None, inner, None, None, None, None, None)
    assert isinstance(groups.bridge, mimo_groups.StandInBridge)
    assert groups.bridge.inner is inner and groups.bridge.plan is None
    assert torch.equal(groups.bridge.communicate(torch.zeros(2)), torch.ones(2))
    # only the protocol's calls reach the object; one it lacks names the fix
    assert not hasattr(groups.bridge, "anything_else")
    with pytest.raises(AttributeError, match=r"has no communicate_ragged\(\).*LocalBridge"):
        groups.bridge.communicate_ragged(torch.zeros(2), [2])
    bridge = LocalBridge()
    assert MimoGroups(None, None, bridge, None, None, None, None, None).bridge is bridge


class _LossOnlyFlow(MimoFlow):
    name = "loss-only"

    def loss(self, parts, inputs):
        raise AssertionError("not reached")


def test_a_flow_without_a_delivery_is_refused_with_a_pipelined_llm():
    # check_pipelined runs first: nothing else of the step (not even the parts) is touched.
    with pytest.raises(ValueError, match=r"a pipelined LLM runs flow .*_LossOnlyFlow\(\)"):
        pipelined_step(None, None, pipeline=None, microbatches=2, flow=_LossOnlyFlow())


# A switch on the flow's name, or a probe of the bridge's type or optional attributes.
_DISPATCH = re.compile(
    r"flow ?==|flow\.name ?(not )?in|\.name ?== ?[\"'](gather|routed)"
    r"|isinstance\([^)]*, *ColocatedBridgeCommunicator\)|getattr\([^)]*bridge[^)]*\"plan\""
)


def test_no_module_of_the_models_dispatches_on_a_flow_name_or_a_bridge_type():
    hits = [
        f"{path.relative_to(MODELS)}:{n}: {line.strip()}"
        for path in sorted(MODELS.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _DISPATCH.search(line)
    ]
    assert hits == []


def test_the_dispatch_pattern_catches_what_it_forbids():
    for line in (
        'if flow == "routed":',
        'if self.flow.name not in ("gather", "routed"):',
        "if isinstance(parts.bridge, ColocatedBridgeCommunicator):",
        'plan = getattr(self.groups.bridge, "plan", None)',
    ):
        assert _DISPATCH.search(line), line
