"""The process groups one communicator uses, made by one function.

=========  ==========================================  =====================================
group      members (this rank's)                       made
=========  ==========================================  =====================================
gather     its gather group (``plan.gather_groups``)   at construction (none for EQUAL or
                                                       LLM PP > 1)
cp         its dest CP group (``plan.cp_groups``)      at construction, when dest CP > 1
world      every rank of the grids                     at construction (the default group
                                                       when the grids cover the world)
route      its route group (``route_groups(plan)``)    on the first ``route`` (or on
                                                       ``prepare_route()``)
=========  ==========================================  =====================================

Creating a group is collective over the whole world: every rank, even one outside the
grids, creates every group of size > 1 in the same order. The dest CP group belongs to the
grid when the grid is a ``HyperCommGrid``: the grid's ``'cp'`` group is borrowed, or made on
the grid with ``create_pg('cp')`` when it lacks one (the grid owns it and ``destroy_grid``
frees it); a pure :class:`~mp_bridge.grid.GridLayout` holds no groups, so the CP groups are
made here and owned like the others. A route group equal to a dest CP group (dest tp = 1)
reuses it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from mp_bridge.comm.bridge.plans.bridge_plan import BridgePlan
from mp_bridge.comm.bridge.plans.route import route_groups
from mp_bridge.grid import MISSING_PG_ERRORS

__all__ = ["BridgeGroups", "make_bridge_groups", "make_route_group", "make_world_group"]

PARTS = ("dense", "world", "route")


@dataclass
class BridgeGroups:
    """This rank's groups (``None``: a group of one rank, or not made yet).

    ``route_members``: the ranks of this rank's route group (``()`` until made);
    ``made``: the parts made so far (``'dense'``: gather + cp, ``'world'``, ``'route'``);
    ``owned``: the groups made here, freed by :meth:`release`.
    """

    gather: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    world: dist.ProcessGroup | None = None
    route: dist.ProcessGroup | None = None
    route_members: tuple[int, ...] = ()
    made: set[str] = field(default_factory=set)
    owned: list[dist.ProcessGroup] = field(default_factory=list)

    def release(self) -> None:
        """Free every owned group and forget them all (every rank, like creation)."""
        owned, self.owned = self.owned, []
        for pg in owned:
            dist.destroy_process_group(pg)
        self.gather = self.cp = self.world = self.route = None
        self.route_members = ()
        self.made = set()


def _new_groups(member_lists, rank: int, owned: list) -> dist.ProcessGroup | None:
    """Create each group (collective, same order everywhere); return this rank's."""
    mine = None
    for members in member_lists:
        pg = dist.new_group(list(members))
        if rank in members:
            mine = pg
            owned.append(pg)
    return mine


def _grid_cp_group(plan: BridgePlan, rank: int, dest_grid: Any, owned: list):
    if not hasattr(dest_grid, "get_pg"):  # a GridLayout: the groups are ours
        return _new_groups(plan.cp_groups, rank, owned)
    try:
        pg = dest_grid.get_pg("cp")
    except MISSING_PG_ERRORS:  # the error type differs by megatron-core version
        pg = dest_grid.create_pg("cp")
    if rank in plan.src.ranks:
        expected = list(plan.cp_group_of(rank))
        got = dist.get_process_group_ranks(pg) if pg is not None else None
        if got != expected:
            raise ValueError(
                f"dest_grid.get_pg('cp') on rank {rank} holds ranks {got} but the dest layout "
                f"{plan.dest!r} puts this rank's CP group at {expected}; build the grid's "
                f"groups with create_pg('cp')"
            )
    return pg


def make_route_group(plan: BridgePlan, rank: int, cp_group: dist.ProcessGroup | None):
    """``(group, members, owned)``: this rank's route group (collective; a route group
    equal to a dest CP group reuses ``cp_group``). ``owned``: groups created."""
    mine, members_of, owned = None, (rank,), []
    cp_groups = set(plan.cp_groups)  # a set: one lookup per group, not a scan of all
    for members in route_groups(plan):
        if len(members) < 2 or members in cp_groups:
            if rank in members:
                mine, members_of = (cp_group if len(members) > 1 else None), members
            continue
        pg = dist.new_group(list(members))
        if rank in members:
            mine, members_of = pg, members
            owned.append(pg)
    return mine, members_of, owned


def make_world_group(plan: BridgePlan, rank: int, world: int):
    """``(group, owned)``: a group of every rank of the grids: the default group when they
    cover the ``world`` ranks, else a new one (collective); ``None`` for a one-rank grid
    or a rank outside it."""
    ranks = plan.src.ranks
    if len(ranks) == 1:
        return None, []
    if ranks == range(world):
        return dist.group.WORLD, []
    pg = dist.new_group(list(ranks))
    return (pg, [pg]) if rank in ranks else (None, [])


def make_bridge_groups(
    plan: BridgePlan,
    rank: int,
    world_size: int,
    *,
    parts: Collection[str],
    dest_grid: Any = None,
    into: BridgeGroups | None = None,
) -> BridgeGroups:
    """Make the ``parts`` of :class:`BridgeGroups` not made yet (into ``into`` if given).

    Collective over the world (see the module docstring), then one world barrier: gloo
    finishes a new group's handshakes asynchronously, and a rank that destroyed a group at
    once could close a socket a peer is still handshaking on. On error the groups made by
    this call are freed before the error propagates.
    """
    unknown = sorted(set(parts) - set(PARTS))
    assert not unknown, unknown
    groups = BridgeGroups() if into is None else into
    todo = [p for p in PARTS if p in parts and p not in groups.made]
    if not todo:
        return groups
    owned: list[dist.ProcessGroup] = []
    try:
        if "dense" in todo:
            # EQUAL's gather groups are single ranks; with LLM PP > 1 the delivery to the
            # first stage runs over the world group and nothing is gathered.
            if plan.scale > 1 and plan.pp_size == 1:
                groups.gather = _new_groups(plan.gather_groups, rank, owned)
                # torch orders a group's ranks ascending, as the plan orders its members
                # (by dp coordinate): slot == group rank.
                assert groups.gather is None or dist.get_process_group_ranks(groups.gather) == list(
                    plan.gather_group_of(rank)
                )
            if plan.cp_size > 1:
                groups.cp = _grid_cp_group(plan, rank, dest_grid, owned)
        if "world" in todo:
            groups.world, made = make_world_group(plan, rank, world_size)
            owned += made
        if "route" in todo:
            groups.route, groups.route_members, made = make_route_group(plan, rank, groups.cp)
            owned += made
    except BaseException:
        for pg in owned:
            dist.destroy_process_group(pg)
        raise
    groups.owned += owned
    groups.made.update(todo)
    dist.barrier()
    return groups
