"""Build a :class:`ColocatedMimoModel` on two grids from a single-process reference model.

Wiring (every rank of the world calls these with the same arguments: group creation and
destruction are collective)::

    enc_grid = make_grid(tp=2, dp=4)
    llm_grid = make_grid(tp=2, cp=2, dp=2)
    mimo = build_colocated_mimo(reference, enc_grid, llm_grid)  # make_mimo_groups inside
    ...
    destroy_colocated_mimo(mimo, enc_grid, llm_grid)  # MimoGroups.destroy inside

Or in two explicit steps: ``groups = make_mimo_groups(enc_grid, llm_grid)``, then
``ColocatedMimoModel.from_groups(reference, groups)``, and ``groups.destroy()`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.checks import FrozenSpec, agree, agreed
from mp_bridge.grid import GridLayout, destroy_grid
from mp_bridge.models.colocated.mimo import ColocatedMimoModel
from mp_bridge.models.colocated.mimo_groups import GridsSpec
from mp_bridge.models.colocated.mimo_options import MimoOptions
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.reference.model import ReferenceMimo

__all__ = ["MimoBuildSpec", "build_colocated_mimo", "destroy_colocated_mimo"]


@dataclass(frozen=True)
class MimoBuildSpec(FrozenSpec):
    """What every rank of the grids builds the model with: the grids and the agreed
    options (:meth:`MimoOptions.agreed`); ``fields()`` names each option."""

    grids: GridsSpec
    options: tuple[tuple[str, object], ...]

    def fields(self) -> dict[str, object]:
        return {"grids": self.grids, **dict(self.options)}


@agreed("mp_bridge.models.build_colocated_mimo")
def build_colocated_mimo(
    reference: ReferenceMimo | MimoConfig,
    encoder_grid: HyperCommGrid,
    llm_grid: HyperCommGrid,
    **options,
) -> ColocatedMimoModel:
    """Shard ``reference`` into encoder (``tp``/``dp``) and LLM (``tp``/``cp``/``dp``) grids.

    ``reference`` may be a :class:`MimoConfig` instead: then no full model exists on any
    rank; each rank allocates only its shards, filled by a seeded per-shard init
    (:func:`~mp_bridge.models.parallel.shard_init.init_shards_`) until :func:`load_hf` or
    ``checkpoint.load`` fills them.

    ``options``: the build options of :class:`~.mimo_options.MimoOptions` (``sequence_parallel``,
    ``fused_loss``, ``device``, ``flow``, ``microbatches``, ``schedule``, ``balance``,
    ``cp_comm``).
    Every group comes from ``make_mimo_groups(encoder_grid, llm_grid)`` (groups the grids
    lack are created on them; one bridge). Release them with :func:`destroy_colocated_mimo`.
    ``flow``: ``"gather"`` or ``"routed"``; ``balance``: see :class:`ColocatedMimoModel`. The grids'
    layouts are agreed over the world by the bridge's constructor; then every rank of the
    grids agrees on the grids and options (:class:`MimoBuildSpec`, over the encoder TP and
    DP groups: together the grid) before the model is returned. Ranks outside the grids
    take part in the group creations only (they build the bridge, not the model).
    An LLM grid with ``pp > 1`` gives each rank its pipeline stage; ``microbatches`` and
    ``schedule`` drive :meth:`ColocatedMimoModel.train_step` then.
    """
    grids = GridsSpec.of(*(GridLayout.from_grid(g) for g in (encoder_grid, llm_grid)))
    spec = MimoBuildSpec(grids, MimoOptions(**options).agreed())
    model = ColocatedMimoModel.from_full(reference, encoder_grid, llm_grid, **options)
    groups = [model.groups.encoder_tp, model.groups.encoder_dp]
    agree("build_colocated_mimo", groups, spec, device=next(model.llm.parameters()).device)
    return model


def destroy_colocated_mimo(model: ColocatedMimoModel, *grids: HyperCommGrid) -> None:
    """Free what built the model's groups, mirroring their creation.

    ``model.groups.destroy()``: the bridge, then the groups of the grids it owns (a model
    from :func:`build_colocated_mimo` / ``from_groups``: both grids). Then the groups of
    ``grids`` (idempotent: grids already freed are skipped).
    Collective: every rank calls it with the same grids, like the group creations.
    """
    model.destroy()
    model.groups.destroy()
    for grid in grids:
        destroy_grid(grid)
