"""Every process group a colocated MIMO model uses, built in one explicit step.

:func:`make_mimo_groups` is the only place a colocated model's groups are created: the
grids' axis groups it needs (created on the grids with ``create_pg`` when missing, so the
grids own them) and the bridge (which owns its gather groups and takes its dest CP group
from ``llm_grid``). :meth:`MimoGroups.destroy` mirrors it: the bridge first, then every
group of both grids. Models only receive groups.

Groups used, per rank (axes a grid does not name have size 1 and give ``None``):

============  ==============  ==================================================
field         grid, axes      used by
============  ==============  ==================================================
encoder_tp    encoder ``tp``  encoder and projection linears, image agreement
encoder_dp    encoder ``dp``  encoder gradient sync, image agreement
llm_tp        llm ``tp``      vocab layers, linears, loss, SP norms' gradient sync
llm_cp        llm ``cp``      CP attention, partition adapter, bridge backward
llm_dp_cp     llm ``dp, cp``  loss denominator, LLM gradient sync (per tp, pp)
llm_pp        llm ``pp``      the LLM pipeline's stages (only when pp > 1)
llm_embed     llm ``pp`` ends a tied head's gradient sum (pp > 1, first and last
                              stage only; pp = 2: ``llm_pp`` itself)
============  ==============  ==================================================

``llm_embed`` is Megatron's embedding group: for each ``(tp, cp, dp)`` coordinate, the
first and the last stage of its pipeline (the lowest and highest rank of each ``pp``
group). With ``pp = 2`` that is the ``pp`` group, reused; with ``pp > 2`` one group per
pipeline is made with ``dist.new_group`` (every rank, in pipeline order), owned by the
:class:`MimoGroups` and freed by its ``destroy``; middle stages get ``None``.

Example (8 ranks, ``encoder_grid = make_grid(tp=2, dp=4)``, ``llm_grid = make_grid(tp=2,
cp=2, dp=2)``): rank 5 gets ``encoder_tp`` ``[4, 5]``, ``encoder_dp`` ``[1, 3, 5, 7]``,
``llm_tp`` ``[4, 5]``, ``llm_cp`` ``[5, 7]``, ``llm_dp_cp`` ``[1, 3, 5, 7]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid

from mp_bridge.checks import FrozenSpec, agreed, check_group
from mp_bridge.comm import Bridge, ColocatedBridgeCommunicator, LocalBridge, group_size, plan_bridge
from mp_bridge.deprecations import warn_deprecated
from mp_bridge.grid import MISSING_PG_ERRORS, GridLayout, destroy_grid

__all__ = [
    "ENCODER_AXES",
    "GridsSpec",
    "StandInBridge",
    "LLM_AXES",
    "MimoGroups",
    "check_members",
    "grid_group",
    "groups_of_bridge",
    "make_mimo_groups",
]

#: Field of :class:`MimoGroups` -> the axes of its grid it spans.
ENCODER_AXES = {"encoder_tp": ("tp",), "encoder_dp": ("dp",)}
LLM_AXES = {"llm_tp": ("tp",), "llm_cp": ("cp",), "llm_dp_cp": ("dp", "cp")}
#: The pipeline group, made only when the LLM grid has ``pp > 1``.
PP_AXES = {"llm_pp": ("pp",)}

#: The deprecation row of a bridge object that is not a ``Bridge`` (:class:`StandInBridge`).
_STAND_IN = "mp_bridge.models.MimoGroups(bridge=<an object that is not a Bridge>)"

#: Where a caller finds each group on its grids.
_WHERE = {
    "encoder_tp": "encoder_grid.get_pg('tp')",
    "encoder_dp": "encoder_grid.get_pg('dp')",
    "llm_tp": "llm_grid.get_pg('tp')",
    "llm_cp": "llm_grid.get_pg('cp')",
    "llm_dp_cp": "llm_grid.get_pg(['dp', 'cp'])",
    "llm_pp": "llm_grid.get_pg('pp')",
    "llm_embed": "make_mimo_groups(encoder_grid, llm_grid).llm_embed",
}


class StandInBridge:
    """A user's single-process bridge object that is not a :class:`~mp_bridge.comm.Bridge`
    (one with some of the row moves, e.g. only ``communicate``, as the deprecated
    constructor form of ``ColocatedMimoModel`` accepted) as a one-process ``Bridge``: no
    plan, group or grid; each row move goes to the object, and one it lacks is an
    ``AttributeError`` naming the fix. Deprecated with that form (``mp_bridge.deprecations``,
    removed in 0.3.0): pass a :class:`~mp_bridge.comm.Bridge` (``LocalBridge`` for one
    process). Only the ``Bridge`` protocol's calls are forwarded (no ``__getattr__``), so
    a model can never reach past the protocol into the user's object."""

    plan = None
    world_group = None
    src_grid = None
    dest_grid = None

    def __init__(self, bridge: object):
        self.inner = bridge

    def _call(self, name: str):
        fn = getattr(self.inner, name, None)
        if fn is None:
            raise AttributeError(
                f"the bridge {self.inner!r} has no {name}(), which this model's flow calls; "
                "pass a mp_bridge.comm.Bridge (LocalBridge() for one process, "
                "ColocatedBridgeCommunicator on grids)"
            )
        return fn

    def communicate(self, x):
        return self._call("communicate")(x)

    def communicate_ragged(self, x, tokens_per_sample):
        return self._call("communicate_ragged")(x, tokens_per_sample)

    def route(self, x, **kwargs):
        return self._call("route")(x, **kwargs)

    def destroy(self) -> None:
        destroy = getattr(self.inner, "destroy", None)
        if destroy is not None:
            destroy()

    def __repr__(self) -> str:
        return f"StandInBridge({self.inner!r})"


def as_bridge(bridge: object) -> Bridge:
    """``bridge`` itself when it is a :class:`~mp_bridge.comm.Bridge`, else (deprecated,
    warns) a :class:`StandInBridge` around it."""
    if isinstance(bridge, (Bridge, StandInBridge)):
        return bridge
    warn_deprecated(_STAND_IN, stacklevel=4)
    return StandInBridge(bridge)


def grid_group(grid: Any, axes: Sequence[str], *, create: bool = False):
    """This rank's group of ``grid`` over ``axes`` (megatron ``HyperCommGrid``).

    Axes the grid does not name are dropped (size 1); ``None`` if none is left. A group
    the grid lacks is created with ``grid.create_pg`` when ``create`` (collective over the
    world: every rank calls it in the same order), else ``ValueError`` naming the fix.
    ``None`` is also what megatron returns on a rank outside the grid.
    """
    present = [a for a in axes if a in tuple(grid.dim_names)]
    if not present:
        return None
    key = present[0] if len(present) == 1 else present
    try:
        return grid.get_pg(key)
    except MISSING_PG_ERRORS:  # the error type differs by megatron-core version
        if create:
            return grid.create_pg(key)
    raise ValueError(
        f"grid {list(grid.dim_names)} {list(grid.shape)} has no {key!r} process group; "
        f"create it with make_grid(..., create=[..., {key!r}]) or build every group with "
        "make_mimo_groups(encoder_grid, llm_grid)"
    )


@dataclass(frozen=True)
class MimoGroups:
    """This rank's groups of a colocated model (see the module table) and its bridge.

    Built by :func:`make_mimo_groups` (which owns the grids: ``destroy`` frees their
    groups), by :meth:`local` (one process, no group) or from a bridge and groups made
    elsewhere (:func:`groups_of_bridge`: grids ``None``, their owner frees them).
    Freed by :meth:`destroy` (collective, every rank).
    """

    encoder_grid: HyperCommGrid | None
    llm_grid: HyperCommGrid | None
    bridge: Bridge
    encoder_tp: dist.ProcessGroup | None
    encoder_dp: dist.ProcessGroup | None
    llm_tp: dist.ProcessGroup | None
    llm_cp: dist.ProcessGroup | None
    llm_dp_cp: dist.ProcessGroup | None
    llm_pp: dist.ProcessGroup | None = None
    llm_embed: dist.ProcessGroup | None = None
    #: groups made here that no grid holds (``llm_embed`` at pp > 2), freed by destroy
    owned: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bridge", as_bridge(self.bridge))
        for name in (*ENCODER_AXES, *LLM_AXES, *PP_AXES, "llm_embed"):
            check_group(f"MimoGroups.{name}", getattr(self, name), fix=f"e.g. {_WHERE[name]}")

    @classmethod
    def local(cls) -> MimoGroups:
        """One process: a :class:`LocalBridge` and no process group."""
        return cls(None, None, LocalBridge(), None, None, None, None, None)

    def embedding_group(self) -> dist.ProcessGroup:
        """On a first or last stage of a tied pipeline: ``llm_embed`` (``llm_pp`` when it
        is ``None`` and pp = 2); ``ValueError`` unless it holds exactly this rank's
        pipeline's first and last rank (local check)."""
        pipe = sorted(dist.get_process_group_ranks(self.llm_pp))
        group = self.llm_embed
        if group is None and len(pipe) == 2:
            group = self.llm_pp
        got = None if group is None else sorted(dist.get_process_group_ranks(group))
        if got != [pipe[0], pipe[-1]]:
            raise ValueError(
                f"groups.llm_embed on rank {dist.get_rank()} holds ranks {got} but a tied "
                f"head at pp={len(pipe)} sums the embedding's gradient over this pipeline's "
                f"first and last rank {[pipe[0], pipe[-1]]}; build the groups with "
                "make_mimo_groups"
            )
        return group

    def destroy(self) -> None:
        """Free the bridge's groups, then every group of the grids it owns (idempotent).

        Collective like :func:`make_mimo_groups`: every rank of the world calls it.
        """
        self.bridge.destroy()
        owned, self.owned[:] = list(self.owned), []
        for pg in owned:
            dist.destroy_process_group(pg)
        for grid in (self.llm_grid, self.encoder_grid):
            if grid is not None:
                destroy_grid(grid)


@dataclass(frozen=True)
class GridsSpec(FrozenSpec):
    """The grids a model's groups are built on: both layouts (shape, axis names, rank
    offset)."""

    encoder: tuple[tuple[int, ...], tuple[str, ...], int]
    llm: tuple[tuple[int, ...], tuple[str, ...], int]

    @classmethod
    def of(cls, encoder: GridLayout, llm: GridLayout) -> GridsSpec:
        key = lambda g: (tuple(g.shape), tuple(g.axis_names), g.rank_offset)  # noqa: E731
        return cls(key(encoder), key(llm))


@agreed("mp_bridge.models.make_mimo_groups")
def make_mimo_groups(encoder_grid: Any, llm_grid: Any) -> MimoGroups:
    """Create (or reuse) every group a colocated model on these grids needs.

    ``encoder_grid`` (``tp`` x ``dp``) and ``llm_grid`` (``tp`` x ``cp`` x ``pp`` x ``dp``) are
    megatron ``HyperCommGrid`` s (``make_grid``) on the same ranks. Groups they already hold
    are reused; missing ones are created on them (``create_pg``), encoder grid first, in
    the order of the module table; then the bridge is built. The layouts are checked
    (``plan_bridge``) before any collective; the ranks agree on them in the bridge's
    constructor (over the world: the ranks outside the grids, which build only the bridge,
    take part). The bridge's route group is not made here: the routed flow's first step makes it
    (``route``; every rank of the grids runs that step), a gather-flow model never does.

    Collective: every rank of the world calls it with the same grids, in the same order
    as its other group creations, even ranks outside the grids.
    """
    for name, grid in (("encoder_grid", encoder_grid), ("llm_grid", llm_grid)):
        if not isinstance(grid, HyperCommGrid):
            raise TypeError(
                f"{name} must be a megatron HyperCommGrid (make_grid returns one), got "
                f"{type(grid).__name__}; a GridLayout holds no process groups"
            )
    llm = GridLayout.from_grid(llm_grid)
    plan_bridge(GridLayout.from_grid(encoder_grid), llm, pipeline=True)
    tables = [(encoder_grid, ENCODER_AXES), (llm_grid, LLM_AXES)]
    if llm.axis_size("pp") > 1:
        tables.append((llm_grid, PP_AXES))
    groups = {
        field: grid_group(grid, axes, create=True)
        for grid, table in tables
        for field, axes in table.items()
    }
    owned: list[dist.ProcessGroup] = []
    if llm.axis_size("pp") > 1:
        groups["llm_embed"] = _embedding_group(llm, groups["llm_pp"], owned)
    bridge = ColocatedBridgeCommunicator(encoder_grid, llm_grid)  # its barrier: ours too
    return MimoGroups(encoder_grid, llm_grid, bridge, **groups, owned=owned)


def _embedding_group(llm: GridLayout, pp_group, owned: list) -> dist.ProcessGroup | None:
    """This rank's embedding group (module docstring): ``pp_group`` when pp = 2, else one
    new group per pipeline, made on every rank of the world in the same order (collective),
    the ones this rank is in appended to ``owned``; ``None`` off the first/last stage."""
    if llm.axis_size("pp") == 2:
        return pp_group
    rank, mine = dist.get_rank(), None
    pipelines = sorted({tuple(sorted(llm.group_of(r, ["pp"]))) for r in llm.ranks})
    for pipe in pipelines:
        ends = [pipe[0], pipe[-1]]
        pg = dist.new_group(ends)
        if rank in ends:
            mine = pg
            owned.append(pg)
    return mine


def groups_of_bridge(
    bridge: Bridge,
    *,
    encoder_tp: dist.ProcessGroup | None,
    llm_tp: dist.ProcessGroup | None,
    llm_cp: dist.ProcessGroup | None,
    encoder_dp: dist.ProcessGroup | None = None,
    llm_dp_cp: dist.ProcessGroup | None = None,
) -> MimoGroups:
    """A :class:`MimoGroups` around a bridge and groups made elsewhere (creates nothing).

    A DP group left out is looked up on a real bridge's grids (``src_grid.get_pg('dp')``,
    ``dest_grid.get_pg(['dp', 'cp'])``; none needed where the layout's group is one rank);
    ``ValueError`` naming the fix when the grid lacks it. A bridge without a plan
    (:class:`~mp_bridge.comm.LocalBridge`, a :class:`StandInBridge`) is a single-process
    one. The grids stay their owner's (``destroy`` frees the bridge only). Local: no
    collective.
    """
    bridge = as_bridge(bridge)
    plan = bridge.plan
    if plan is not None:
        rank = dist.get_rank()
        plan.check_member(rank, "groups_of_bridge()")
        found = {"encoder_dp": encoder_dp, "llm_dp_cp": llm_dp_cp}
        for field, grid, layout, axes, arg in (
            ("encoder_dp", bridge.src_grid, plan.src, ("dp",), "encoder_dp_group"),
            ("llm_dp_cp", bridge.dest_grid, plan.dest, ("dp", "cp"), "llm_dp_cp_group"),
        ):
            if found[field] is not None or len(_members_of(layout, axes, rank)) == 1:
                continue
            if not isinstance(grid, HyperCommGrid):
                raise ValueError(
                    f"{arg} was not given and the bridge's grid holds no process groups; "
                    f"pass {arg}={_WHERE[field]} or build the model with "
                    "build_colocated_mimo / make_mimo_groups"
                )
            try:
                found[field] = grid_group(grid, axes)
            except ValueError as exc:
                raise ValueError(f"{arg} was not given and {exc}") from None
        encoder_dp, llm_dp_cp = found["encoder_dp"], found["llm_dp_cp"]
    return MimoGroups(None, None, bridge, encoder_tp, encoder_dp, llm_tp, llm_cp, llm_dp_cp)


def check_members(
    groups: MimoGroups, used: Sequence[tuple[str, dist.ProcessGroup | None, str]]
) -> None:
    """Every group a model uses holds the ranks the bridge's layouts say (local check).

    ``used``: ``(name, group, field)`` rows: ``group`` (named ``name`` in the error) must
    span the axes of :class:`MimoGroups` field ``field`` around this rank. With a bridge's
    plan the ranks are compared with it (``ValueError`` naming the group, its ranks and the
    expected ones, before any collective); without one (one process:
    :class:`~mp_bridge.comm.LocalBridge`) every group must be ``None`` or of size 1.
    """
    bridge = groups.bridge
    plan = bridge.plan
    if plan is None:
        for name, group, _ in used:
            if group_size(group) != 1:
                raise ValueError(
                    f"{name} spans {group_size(group)} ranks but the bridge {bridge!r} is a "
                    "single-process one; build the groups with make_mimo_groups"
                )
        return
    rank = dist.get_rank()
    plan.check_member(rank, "ColocatedMimoModel(...)")
    for name, group, field in used:
        layout, axes = (plan.src, ENCODER_AXES[field]) if field in ENCODER_AXES else (
            plan.dest, {**LLM_AXES, **PP_AXES}[field])  # fmt: skip
        expected = _members_of(layout, axes, rank)
        got = [rank] if group is None else sorted(dist.get_process_group_ranks(group))
        if got != expected:
            raise ValueError(
                f"{name} on rank {rank} holds ranks {got} but the layout {layout!r} puts "
                f"this rank's {'x'.join(axes)} group at {expected}; pass the grid's group, "
                f"e.g. {_WHERE[field]}"
            )


def _members_of(layout: GridLayout, axes: Sequence[str], rank: int) -> list[int]:
    """Sorted ranks of ``rank``'s group over ``axes`` (axes the layout lacks have size 1)."""
    present = [a for a in axes if a in layout.axis_names]
    return sorted(layout.group_of(rank, present)) if present else [rank]
