"""The bridge of a single process: the encoder's batch is the LLM's, nothing moves.

The second :class:`~mp_bridge.comm.bridge.bridge_protocol.Bridge` beside
:class:`~mp_bridge.comm.ColocatedBridgeCommunicator`: same calls, no collectives, and
``plan``, ``world_group`` and both grids ``None``. :meth:`MimoGroups.local()
<mp_bridge.models.colocated.mimo_groups.MimoGroups.local>` pairs it with no process group,
so a ``ColocatedMimoModel`` runs in one process (both flows) with exactly the reference
math.
"""

from __future__ import annotations

import torch

__all__ = ["LocalBridge"]


class LocalBridge:
    """Identity bridge for one process (encoder layout = LLM layout = one rank)."""

    #: One process: no plan to check groups against, no group, no grid.
    plan = None
    world_group = None
    src_grid = None
    dest_grid = None

    def communicate(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, p, h]`` -> the same tensor (one rank holds every sample)."""
        return x

    def communicate_ragged(
        self, x: torch.Tensor, tokens_per_sample: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, h]`` and its ``[b]`` counts, unchanged."""
        return x, tokens_per_sample

    def route(
        self,
        x: torch.Tensor,
        *,
        tokens_per_sample: torch.Tensor,
        image_mask: torch.Tensor,
        partition,
        cu_seqlens=None,
        layout=None,
        balance=None,
    ) -> torch.Tensor:
        """``x [T, h]``: with CP = 1 and no SP split the local shard is the whole batch in
        order, so its image rows are ``x`` itself (``cu_seqlens``/``layout`` change
        nothing). ``balance``: a ``BalancePlan`` of one replica (nothing moved), or
        ``None``."""
        if partition.cp_size != 1 or (partition.sequence_parallel and partition.tp_size > 1):
            raise ValueError(
                f"LocalBridge.route got a partition with cp={partition.cp_size}, "
                f"tp={partition.tp_size}, sequence_parallel={partition.sequence_parallel}; "
                "one process shards nothing: use PartitionAdapter() (or a real bridge)"
            )
        if balance is not None and balance.replicas != 1:
            raise ValueError(
                f"LocalBridge.route got {balance!r}; one process is one encoder replica: "
                "pass balance=None or a plan of one replica"
            )
        want, have = int(torch.as_tensor(tokens_per_sample).sum()), int(image_mask.sum())
        if want != have or x.shape[0] != have:
            raise ValueError(
                f"image_mask holds {have} image positions but images give {want} tokens "
                f"(x has {x.shape[0]} rows); put one placeholder per image token"
            )
        return x

    def destroy(self) -> None:
        """Nothing to free."""

    def __repr__(self) -> str:
        return "LocalBridge()"
