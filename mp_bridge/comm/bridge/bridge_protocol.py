"""What a colocated model asks of its bridge: :class:`Bridge`, one protocol, two bridges.

- :class:`~mp_bridge.comm.bridge.execution.communicator.ColocatedBridgeCommunicator`:
  the encoder grid's rows to the LLM grid's, over process groups (``plan`` its
  :class:`~mp_bridge.comm.bridge.plans.bridge_plan.BridgePlan`);
- :class:`~mp_bridge.comm.bridge.local_bridge.LocalBridge`: one process, nothing moves
  (``plan``, ``world_group`` and both grids ``None``).

A model calls the three row moves and reads ``plan`` / ``world_group`` / the grids, never
the bridge's type: ``plan is None`` is how it knows there is one rank and no layout to
check its groups against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from mp_bridge.comm.bridge.plans.balance_plan import BalancePlan
from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.sequence.padding import PaddedLayout
from mp_bridge.comm.sequence.partition import PartitionAdapter

__all__ = ["Bridge"]


@runtime_checkable
class Bridge(Protocol):
    """The colocated bridge a model runs with (contracts: ``ColocatedBridgeCommunicator``).

    - ``communicate(x)``: ``[b_e, *rest]`` (encoder DP batch) -> ``[b_l, *rest]`` (LLM DP
      batch);
    - ``communicate_ragged(x, tokens_per_sample)``: ``[T_e, *rest]`` -> ``([T_l, *rest],
      [b_l] counts)``;
    - ``route(x, *, tokens_per_sample, image_mask, partition, cu_seqlens=None,
      layout=None, balance=None)``: ``[T_e, *rest]`` -> ``[n_local, *rest]``, the image
      rows of this rank's CP/SP shard in shard order (``balance``: the ``BalancePlan`` the
      rows were encoded under);
    - ``destroy()``: free what the bridge created.

    ``plan``: the layouts' plan (``None``: one process); ``world_group``: every rank of
    the grids (``None``: one rank); ``src_grid`` / ``dest_grid``: the grids it was built
    on (``None``: one process).
    """

    @property
    def plan(self) -> BridgePlan | None: ...

    @property
    def world_group(self) -> Any: ...

    src_grid: Any
    dest_grid: Any

    def communicate(self, x: torch.Tensor) -> torch.Tensor: ...

    def communicate_ragged(
        self, x: torch.Tensor, tokens_per_sample: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def route(
        self, x: torch.Tensor, *, tokens_per_sample: torch.Tensor | Sequence[int],
        image_mask: torch.Tensor, partition: PartitionAdapter,
        cu_seqlens: Sequence[int] | torch.Tensor | None = None,
        layout: PaddedLayout | None = None, balance: BalancePlan | None = None,
    ) -> torch.Tensor: ...  # fmt: skip

    def destroy(self) -> None: ...
