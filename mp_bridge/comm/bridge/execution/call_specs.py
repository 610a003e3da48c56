"""What the ranks of one ``ColocatedBridgeCommunicator`` call compare before its collectives.

Frozen specs for the entry guard (:func:`mp_bridge.checks.agree`): the rows of a call
(:class:`RowsSpec`), ``route``'s rows plus its balance plan (:class:`RouteSpec`), and the
construction (:class:`CommunicatorSpec`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from mp_bridge.checks import FrozenSpec
from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan
from mp_bridge.grid import GridLayout

__all__ = ["CommunicatorSpec", "RouteSpec", "RowsSpec", "layout_key", "plan_code"]


@dataclass(frozen=True)
class RowsSpec:
    """What the ranks of one bridge call compare: the input's shape (or its row shape for
    ragged calls, whose token counts differ), dtype and device type."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str

    def fields(self) -> dict[str, object]:
        return {"x.shape": self.shape, "x.dtype": self.dtype, "x.device": self.device}


@dataclass(frozen=True)
class CommunicatorSpec(FrozenSpec):
    """What every rank of the world builds the communicator with: both layouts (shape,
    axis names, offset) and the dim mapping (names only label messages: not compared)."""

    src: tuple[tuple[int, ...], tuple[str, ...], int]
    dest: tuple[tuple[int, ...], tuple[str, ...], int]
    dim_mapping: tuple[tuple[str, int], ...]


def layout_key(layout: GridLayout) -> tuple[tuple[int, ...], tuple[str, ...], int]:
    return tuple(layout.shape), tuple(layout.axis_names), layout.rank_offset


@dataclass(frozen=True)
class RouteSpec(RowsSpec):
    """``route``'s spec: the row spec and a code of its ``balance`` plan (0: none)."""

    balance: int

    def fields(self) -> dict[str, object]:
        return {**super().fields(), "balance plan code": self.balance}


def plan_code(balance: BalancePlan | None) -> int:
    return 0 if balance is None else zlib.crc32(repr((balance.tokens, balance.dest)).encode())
