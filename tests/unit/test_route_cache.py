"""``route`` keeps its plans: a repeated layout is not planned again (one process, no group).

A one-rank bridge (EQUAL, no collective) runs ``parse_route`` then ``run_route`` with a
``PlanCache``; ``plan_route`` is counted through monkeypatch. Also the LRU bound of ``PlanCache``.
"""

from __future__ import annotations

import pytest
import torch

import mp_bridge.comm.bridge.execution.route as route_module
from mp_bridge.comm import PartitionAdapter
from mp_bridge.comm.bridge.execution.route import parse_route, run_route
from mp_bridge.comm.bridge.plans.bridge_plan import plan_bridge
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.grid import GridLayout

ORDER = ("tp", "cp", "pp", "dp")
PLAN = plan_bridge(GridLayout((1, 1, 1, 1), ORDER), GridLayout((1, 1, 1, 1), ORDER))


def _route(cache, positions):
    """Route 2 samples of length 6 with image positions ``positions[i]``; return ``(x, y)``."""
    mask = torch.zeros(2, 6, dtype=torch.bool)
    for i, p in enumerate(positions):
        mask[i, p] = True
    counts = [len(p) for p in positions]
    x = torch.randn(sum(counts), 4)
    call = parse_route(x, counts, mask, PartitionAdapter(), plan=PLAN, rank=0)
    y = run_route(call, plan=PLAN, rank=0, group=None, members=(0,), world_group=None, cache=cache)
    return x, y


def test_a_repeated_layout_is_not_planned_again(monkeypatch):
    calls = []
    original = route_module.plan_route

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(route_module, "plan_route", counting)
    cache = PlanCache(maxsize=8)
    # The plan depends on the token total and the shard of each image token (one shard
    # here): a and a2 share a plan (3 tokens, split differently); b (4) and c (1) do not.
    a, a2, b, c = [[1, 4], [0]], [[2], [3, 5]], [[2], [3, 4, 5]], [[0], []]
    steps = [(a, 1), (a, 1), (a2, 1), (b, 2), (a, 2), (b, 2), (c, 3)]
    for positions, planned in steps:
        x, y = _route(cache, positions)
        assert torch.equal(y, x)  # one rank, no CP: every token stays, in order
        assert len(calls) == planned, positions
    assert len(cache) == 3
    _route(None, a)  # no cache: plans every call
    assert len(calls) == 4


def test_the_cache_keeps_the_most_recent_entries():
    cache, made = PlanCache(maxsize=2), []

    def make(key):
        def build():
            made.append(key)
            return key

        return build

    for key in ["p", "q", "p", "r", "p", "q"]:
        assert cache.get(key, make(key)) == key
    # "q" was evicted by "r" (least recently used after "p" was read again).
    assert made == ["p", "q", "r", "q"]
    assert len(cache) == 2


def test_route_cache_is_a_deprecated_name_of_plan_cache():
    # The cache holds balance plans too (ImageBalancer's), so it is named for plans.
    import mp_bridge.comm as comm

    with pytest.warns(DeprecationWarning, match=r"mp_bridge\.comm\.RouteCache is deprecated.*"
                      r"PlanCache"):  # fmt: skip
        cache = comm.RouteCache(maxsize=3)
    assert isinstance(cache, PlanCache) and cache.maxsize == 3
    assert cache.get("k", lambda: "plan") == "plan"
