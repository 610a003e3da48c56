"""Build a :class:`ColocatedMimoModel` on two grids from a single-process reference model.

Wiring (every rank of the world calls this with the same arguments: group creation is
collective)::

    enc_grid = make_grid(tp=2, dp=4, create=("tp", "dp"))
    llm_grid = make_grid(tp=2, cp=2, dp=2, create=("tp", "cp", "dp", ("dp", "cp")))
    mimo = build_colocated_mimo(reference, enc_grid, llm_grid)
    ...
    destroy_colocated_mimo(mimo, enc_grid, llm_grid)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter
from mp_bridge.grid.destroy import destroy_grid
from mp_bridge.grid.megatron_compat import MISSING_PG_ERRORS

from .encoder import TPEncoder, TPProjection
from .llm import TPLLM
from .mimo import ColocatedMimoModel
from .reference import ReferenceMimo

__all__ = ["build_colocated_mimo", "destroy_colocated_mimo"]


def _pg(grid: HyperCommGrid, dims: str | list[str]) -> dist.ProcessGroup:
    try:
        return grid.get_pg(dims)
    except MISSING_PG_ERRORS:  # KeyError or ValueError, by version and axis
        raise ValueError(
            f"grid {list(grid.dim_names)} {list(grid.shape)} has no {dims!r} process group; "
            f"create it with make_grid(..., create=[..., {dims!r}])"
        ) from None


def _size(grid: HyperCommGrid, name: str) -> int:
    names = list(grid.dim_names)
    return grid.shape[names.index(name)] if name in names else 1


def build_colocated_mimo(
    reference: ReferenceMimo,
    encoder_grid: HyperCommGrid,
    llm_grid: HyperCommGrid,
    *,
    sequence_parallel: bool = False,
    fused_loss: bool = False,
    device: torch.device | None = None,
) -> ColocatedMimoModel:
    """Shard ``reference`` into encoder (``tp``/``dp``) and LLM (``tp``/``cp``/``dp``) grids.

    Needs groups ``tp``, ``dp`` on ``encoder_grid`` and ``tp``, ``cp``, ``["dp", "cp"]`` on
    ``llm_grid``. Creates one bridge (release it with :func:`destroy_colocated_mimo`).
    """
    cfg = reference.cfg
    enc_tp, enc_dp = _pg(encoder_grid, "tp"), _pg(encoder_grid, "dp")
    llm_tp, llm_cp = _pg(llm_grid, "tp"), _pg(llm_grid, "cp")
    llm_dp_cp = _pg(llm_grid, ["dp", "cp"])
    cfg.check_tp(encoder_tp=_size(encoder_grid, "tp"), llm_tp=_size(llm_grid, "tp"))
    encoder = TPEncoder.from_full(reference.encoder, cfg, tp_group=enc_tp, device=device)
    projection = TPProjection.from_full(reference.projection, cfg, tp_group=enc_tp, device=device)
    llm = TPLLM.from_full(
        reference.llm, cfg, tp_group=llm_tp, cp_group=llm_cp,
        sequence_parallel=sequence_parallel, fused_loss=fused_loss, device=device,
    )  # fmt: skip
    bridge = ColocatedBridgeCommunicator(encoder_grid, llm_grid)
    partition = PartitionAdapter(
        cp_group=llm_cp, tp_group=llm_tp, sequence_parallel=llm.sequence_parallel
    )
    return ColocatedMimoModel(
        encoder, projection, llm, bridge, partition, image_token_id=cfg.image_token_id,
        encoder_dp_group=enc_dp, llm_dp_cp_group=llm_dp_cp,
    )  # fmt: skip


def destroy_colocated_mimo(model: ColocatedMimoModel, *grids: HyperCommGrid) -> None:
    """Release the model's own groups, its bridge and the groups of ``grids``.

    Collective: every rank calls it with the same grids, like the group creations.
    """
    model.destroy()
    model.bridge.destroy()
    for grid in grids:
        destroy_grid(grid)
