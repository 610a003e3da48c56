"""The base plan's groups (gather groups, dest CP groups) and its readable table: pure.

Not a mode: every :class:`~.bridge_plan.BridgePlan` holds these groups, whichever call
runs it. The dense bridge (``communicate``) concatenates or narrows whole batch blocks inside one
**gather group** per destination (FAN_IN: one per (dest dp j, src tp t), the ``k`` ranks
with src dp in ``[j·k, j·k+k)``; FAN_OUT: one per (src dp i, dest tp, cp, pp), the ``k``
ranks with dest dp in ``[i·k, i·k+k)``; EQUAL: one single-rank group per rank), ordered
by the dp coordinate that orders the concatenation. Backward sums the gradient over the
**dest CP group** first (single ranks when dest CP = 1).

Example, encoder ``tp=2,dp=4`` -> LLM ``tp=2,cp=2,dp=2`` (FAN_IN, k = 2, tp fastest):
``gather_groups(...)[0] == (0, 2)``: ranks 0 and 2 (src dp 0 and 1) feed LLM replica 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.grid import GridLayout
from mp_bridge.table import format_table

__all__ = ["describe_plan", "dest_cp_groups", "format_rank_table", "gather_groups"]


def gather_groups(
    src: GridLayout, dest: GridLayout, direction: BridgeDirection, k: int
) -> tuple[tuple[int, ...], ...]:
    """Every gather group (module docstring), members in concatenation order, groups
    sorted by the key they serve."""
    # Groups keyed by who they serve; members sorted by the dp coordinate that orders the
    # concatenation (FAN_IN src dp, FAN_OUT dest dp).
    buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    if direction is BridgeDirection.FAN_IN:
        for r in src.ranks:
            s = src.coords(r)
            buckets.setdefault((s["dp"] // k, s["tp"]), []).append((s["dp"], r))
    elif direction is BridgeDirection.FAN_OUT:
        for r in dest.ranks:
            d = dest.coords(r)
            key = (d["dp"] // k, d["tp"], d.get("cp", 0), d.get("pp", 0))
            buckets.setdefault(key, []).append((d["dp"], r))
    else:  # EQUAL: each rank is its own (trivial) gather group, like cp_groups at cp=1
        for r in src.ranks:
            buckets[(r,)] = [(0, r)]
    return tuple(tuple(r for _, r in sorted(buckets[key])) for key in sorted(buckets))


def dest_cp_groups(dest: GridLayout) -> tuple[tuple[int, ...], ...]:
    """The dest CP groups (single ranks when ``dest`` has no ``cp`` axis)."""
    if "cp" in dest.axis_names:
        return tuple(tuple(g) for g in dest.groups("cp"))
    return tuple((r,) for r in dest.ranks)


def describe_plan(plan) -> str:
    """``plan``'s (a :class:`BridgePlan`) readable table: direction, scale, and per rank
    its coords and groups."""
    k, cp = plan.scale, plan.cp_size
    steps = {
        BridgeDirection.FAN_IN: (
            f"all-gather along batch in gather group ({k} ranks)",
            "narrow to this rank's slot",
        ),
        BridgeDirection.FAN_OUT: (
            f"narrow to slot dest_dp mod {k}",
            f"all-gather along batch in gather group ({k} ranks)",
        ),
        BridgeDirection.EQUAL: ("identity", "identity"),
    }[plan.direction]
    bwd = (f"all-reduce(SUM) over dest CP group ({cp} ranks), then " if cp > 1 else "") + steps[1]
    head = [
        f"bridge {plan.src_name} {plan.src!r} -> {plan.dest_name} {plan.dest!r}",
        f"direction {plan.direction.name}, scale {k}, dest cp {cp}",
        f"forward:  {steps[0]}",
        f"backward: {bwd}",
        "",
    ]
    table = format_rank_table(
        plan.src,
        plan.dest,
        plan.src_name,
        plan.dest_name,
        columns=(
            ("slot", lambda r: str(plan.slot_of(r))),
            ("gather group", lambda r: _fmt_group(plan.gather_group_of(r))),
            ("cp group", lambda r: _fmt_group(plan.cp_group_of(r))),
        ),
    )
    return "\n".join(head) + "\n" + table


def format_rank_table(
    src: GridLayout,
    dest: GridLayout,
    src_name: str = "src",
    dest_name: str = "dest",
    *,
    columns: Sequence[tuple[str, Callable[[int], str]]] = (),
) -> str:
    """One row per rank of ``src``: its coords in both layouts (axes of size > 1), then
    one cell per ``(header, cell_of_rank)`` in ``columns``. Pure text, aligned columns::

        rank  encoder    llm             slot
        ----  ---------  --------------  ----
        0     tp=0,dp=0  tp=0,cp=0,dp=0  0
    """
    rows = [("rank", src_name, dest_name, *(h for h, _ in columns))]
    for r in src.ranks:
        rows.append(
            (str(r), _fmt_coords(src, r), _fmt_coords(dest, r), *(f(r) for _, f in columns))
        )
    return format_table(rows)


def _fmt_coords(layout: GridLayout, rank: int) -> str:
    c = layout.coords(rank)
    shown = [f"{n}={c[n]}" for n, s in zip(layout.axis_names, layout.shape) if s > 1]
    return ",".join(shown) or "-"


def _fmt_group(group: tuple[int, ...]) -> str:
    return "[" + ",".join(str(r) for r in group) + "]"
