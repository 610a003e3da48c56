"""A small LRU of pure plans: a repeated layout (or image count list) is not planned again.

The communicator keeps its ``route`` plans (:class:`~.route.RankRoute`, keyed by the
token totals, the shard ids and the SP pieces) in one, and :class:`ImageBalancer` its
balance plans (:class:`~.balance_plan.BalancePlan`, keyed by the counts and costs): a
plan is a pure value of its key, so a hit returns it unchanged. ``RouteCache`` is the
deprecated name (it never held only routes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from mp_bridge.deprecations import warn_deprecated

__all__ = ["PlanCache", "RouteCache"]

P = TypeVar("P")


class PlanCache(Generic[P]):
    """``get(key, make)``: the cached plan of ``key``, else ``make()`` stored; the
    ``maxsize`` most recently used keys are kept."""

    def __init__(self, maxsize: int = 8) -> None:
        self.maxsize = maxsize
        self._plans: OrderedDict[object, P] = OrderedDict()

    def get(self, key: object, make: Callable[[], P]) -> P:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            while len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


class RouteCache(PlanCache):
    """Deprecated: :class:`PlanCache` (``DeprecationWarning`` when built)."""

    def __init__(self, maxsize: int = 8) -> None:
        warn_deprecated("mp_bridge.comm.RouteCache")
        super().__init__(maxsize)
