"""The bridge wing in two halves (pure plans, execution), its public names kept, and the
doors it no longer has (no process group)."""

from __future__ import annotations

import importlib

import mp_bridge.comm as comm
import mp_bridge.comm.bridge as bridge

PUBLIC = (
    "plan_bridge", "BridgePlan", "BridgeDirection", "ColocatedBridgeCommunicator",
    "exchange_rows", "ImageBalancer", "BalancePlan", "plan_balance", "check_sample_counts",
    "RaggedRoute", "route_ragged", "RankRoute", "PlanCache", "plan_route", "route_groups",
    "route_needs", "image_token_shards", "format_rank_table", "BridgeGroups",
    "make_bridge_groups", "CountRow",
)  # fmt: skip


def test_public_names_keep_their_package_homes():
    for name in PUBLIC:
        assert getattr(comm, name) is getattr(bridge, name), name


def test_plans_and_execution_are_the_two_halves():
    plans = importlib.import_module("mp_bridge.comm.bridge.plans")
    execution = importlib.import_module("mp_bridge.comm.bridge.execution")
    assert plans.plan_bridge is comm.plan_bridge
    assert plans.check_tokens_per_sample.__module__ == "mp_bridge.comm.bridge.plans.token_counts"
    assert execution.ColocatedBridgeCommunicator is comm.ColocatedBridgeCommunicator
    assert not hasattr(bridge, "route_image_rows")  # a test-only door, a copy of run_route
    route = importlib.import_module("mp_bridge.comm.bridge.execution.route")
    assert not hasattr(route, "route_image_rows")
