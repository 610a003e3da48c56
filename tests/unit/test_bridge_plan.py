"""plan_bridge: literal plans, error paths, and properties over every small layout (pure)."""

from __future__ import annotations

import ast
import inspect

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from megatron.core.hyper_comm_grid import HyperCommGrid

import mp_bridge.comm.bridge.plans.bridge_plan as bridge_plan_module
from mp_bridge.comm.bridge.plans.bridge_plan import plan_bridge
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.grid import GridLayout

TCD = ("tp", "cp", "dp")


def L(tp=1, cp=1, dp=1, pp=1, *, order=("tp", "cp", "pp", "dp"), offset=0) -> GridLayout:
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    return GridLayout(tuple(sizes[n] for n in order), tuple(order), offset)


# ------------------------------------------------------------ literal plans
def test_fan_in_tp2_dp4_to_tp2_cp2_dp2():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2))
    assert plan.direction is BridgeDirection.FAN_IN and plan.scale == 2 and plan.cp_size == 2
    assert plan.gather_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.cp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.gather_group_of(6) == (4, 6) and plan.cp_group_of(3) == (1, 3)
    # Gathered dest batch of 4: rank 0 (src dp 0) fills rows 0-1, rank 2 (src dp 1) rows 2-3.
    assert plan.slice_for(0, 4) == (0, 2) and plan.slice_for(2, 4) == (2, 2)


def test_fan_out_tp4_dp2_to_tp1_cp2_dp4():
    plan = plan_bridge(L(tp=4, dp=2), L(tp=1, cp=2, dp=4))
    assert plan.direction is BridgeDirection.FAN_OUT and plan.scale == 2
    # One group per (src dp, dest tp, dest cp): dest dp 0,1 with cp 0 -> ranks 0, 2.
    assert plan.gather_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.cp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    # Src batch of 4 on rank 3 (dest dp 1 = slot 1) -> its dest rows 2-3.
    assert plan.slot_of(3) == 1 and plan.slice_for(3, 4) == (2, 2)


def test_equal_dp_with_cp2():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=1, cp=2, dp=4))
    assert plan.direction is BridgeDirection.EQUAL and plan.scale == 1
    assert plan.gather_groups == tuple((r,) for r in range(8))  # one trivial group per rank
    assert plan.gather_group_of(5) == (5,) and plan.slice_for(5, 3) == (0, 3)
    assert plan.cp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_rank_offset():
    plan = plan_bridge(L(tp=2, dp=4, offset=8), L(tp=2, cp=2, dp=2, offset=8))
    assert plan.gather_groups == ((8, 10), (9, 11), (12, 14), (13, 15))
    assert plan.cp_group_of(15) == (13, 15)
    with pytest.raises(ValueError, match=r"rank=0 is outside .* \[8, 16\)"):
        plan.gather_group_of(0)


def test_nesting_custom_orders():
    # src dp fastest (rank = ds + 4·ts), dest cp fastest then dp: dd = ds // 2 on every rank.
    plan = plan_bridge(
        L(tp=2, dp=4, order=("dp", "tp", "cp", "pp")),
        L(tp=2, cp=2, dp=2, order=("cp", "dp", "tp", "pp")),
    )
    assert plan.gather_groups == ((0, 1), (4, 5), (2, 3), (6, 7))


def test_no_cp_axis_gives_single_rank_cp_groups():
    plan = plan_bridge(GridLayout((2, 2), ("tp", "dp")), GridLayout((1, 4), ("tp", "dp")))
    assert plan.direction is BridgeDirection.FAN_OUT and plan.cp_groups == ((0,), (1,), (2,), (3,))


def test_describe_names_direction_scale_and_groups():
    text = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2), src_name="enc", dest_name="llm")
    out = text.describe()
    assert "direction FAN_IN, scale 2, dest cp 2" in out
    assert "all-reduce(SUM) over dest CP group (2 ranks), then narrow" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit()}
    assert rows["6"] == ["6", "tp=0,dp=3", "tp=0,cp=1,dp=1", "1", "[4,6]", "[4,6]"]


def test_plan_module_never_imports_torch_distributed():
    tree = ast.parse(inspect.getsource(bridge_plan_module))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("torch")], names


# Small layouts with every gather group written out by hand (EQUAL: one rank per group).
# Default orders (tp fastest): src rank = t + tp·d; dest rank = t + tp·(c + cp·d').
SMALL_LAYOUTS = {
    "w1_equal": (L(), L(), BridgeDirection.EQUAL, [[0]]),
    "w2_fan_in_dp2_to_cp2": (L(dp=2), L(cp=2), BridgeDirection.FAN_IN, [[0, 1]]),
    "w4_equal_cp2": (L(tp=2, dp=2), L(cp=2, dp=2), BridgeDirection.EQUAL, [[0], [1], [2], [3]]),
    "w4_fan_in_k4": (L(dp=4), L(cp=4), BridgeDirection.FAN_IN, [[0, 1, 2, 3]]),
    "w4_fan_out_k4": (L(tp=4), L(dp=4), BridgeDirection.FAN_OUT, [[0, 1, 2, 3]]),
    # dest replica d' (ranks 2d', 2d'+1) gathers src blocks 2d', 2d'+1 = the same ranks.
    "w4_fan_in_dest_tp2": (L(dp=4), L(tp=2, dp=2), BridgeDirection.FAN_IN, [[0, 1], [2, 3]]),
    # src replica d (ranks 2d, 2d+1) holds dest blocks 2d, 2d+1: its two TP ranks.
    "w4_fan_out_src_tp2": (L(tp=2, dp=2), L(dp=4), BridgeDirection.FAN_OUT, [[0, 1], [2, 3]]),
    "w6_fan_in_k3": (L(dp=6), L(tp=3, dp=2), BridgeDirection.FAN_IN, [[0, 1, 2], [3, 4, 5]]),
    "w6_equal_cp2": (L(tp=2, dp=3), L(cp=2, dp=3), BridgeDirection.EQUAL, [[r] for r in range(6)]),
    # dest rank = c + 2·d': the three dest replicas of one CP rank share a gather group.
    "w6_fan_out_k3_cp2": (
        L(tp=6), L(cp=2, dp=3), BridgeDirection.FAN_OUT, [[0, 2, 4], [1, 3, 5]]
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("src", "dest", "direction", "groups"), list(SMALL_LAYOUTS.values()), ids=list(SMALL_LAYOUTS)
)
def test_gather_groups_of_small_layouts_are_the_written_ones(src, dest, direction, groups):
    plan = plan_bridge(src, dest)
    assert plan.direction is direction and plan.scale == len(groups[0])
    assert sorted(map(list, plan.gather_groups)) == groups
    for group in groups:
        for r in group:
            assert list(plan.gather_group_of(r)) == group, r


def _factorizations(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12])
def test_gather_groups_partition_every_world_in_groups_of_scale(world):
    seen = set()
    for tps, dps in _factorizations(world, 2):
        for tpd, cpd, dpd in _factorizations(world, 3):
            try:
                plan = plan_bridge(L(tp=tps, dp=dps), L(tp=tpd, cp=cpd, dp=dpd))
            except ValueError:
                continue  # DP sizes that do not divide: test_plan_errors
            seen.add(plan.direction)
            members = sorted(r for g in plan.gather_groups for r in g)
            assert members == list(range(world)), (tps, dps, tpd, cpd, dpd, plan.gather_groups)
            assert all(len(g) == plan.scale for g in plan.gather_groups)
            # The scale is the DP ratio, whichever side is larger.
            assert plan.scale == max(dps, dpd) // min(dps, dpd)
    assert BridgeDirection.EQUAL in seen


def test_plan_bridge_reads_hyper_comm_grids_as_written(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # HyperCommGrid checks its size against it
    plan = plan_bridge(
        HyperCommGrid([2, 4], ["tp", "dp"]), HyperCommGrid([2, 2, 2], ["tp", "cp", "dp"])
    )
    assert plan.direction is BridgeDirection.FAN_IN and plan.scale == 2 and plan.cp_size == 2
    assert plan.gather_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert plan.cp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    # Axis order as the grid lists it (first fastest): src rank = ds + 4·ts, dest rank =
    # c + 2·dd + 4·td; dest replica dd gathers src DP blocks 2dd, 2dd + 1 (ranks c = 0, 1).
    dp_first = plan_bridge(
        HyperCommGrid([4, 2], ["dp", "tp"]), HyperCommGrid([2, 2, 2], ["cp", "dp", "tp"])
    )
    assert sorted(dp_first.gather_groups) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert dp_first.gather_group_of(5) == (4, 5)
    with pytest.raises(TypeError, match="dest must be a GridLayout or a HyperCommGrid"):
        plan_bridge(HyperCommGrid([2, 4], ["tp", "dp"]), "tp=2,cp=2,dp=2")


# ------------------------------------------------------------- error paths
@pytest.mark.parametrize(
    ("src", "dest", "match"),
    [
        (L(tp=2, dp=2), L(tp=2, dp=4), r"covers ranks \[0, 4\) .* \[0, 8\).*same ranks"),
        (L(tp=2, dp=2, offset=4), L(tp=2, dp=2), r"covers ranks \[4, 8\) .* \[0, 4\)"),
        (GridLayout((8,), ("dp",)), L(tp=2, dp=4), r"has no axis \['tp'\]"),
        (L(tp=8), GridLayout((8,), ("tp",)), r"dest grid .* has no axis \['dp'\]"),
        (L(tp=2, cp=2, dp=2), L(tp=2, dp=4), r"src grid .* has cp=2; .*src cp=1"),
        (L(tp=2, pp=2, dp=2), L(tp=2, dp=4), r"src grid .* has pp=2; .*pp=1 only"),
        (L(tp=2, dp=4), L(tp=2, pp=2, dp=2), r"dest grid .* has pp=2; .*pipeline=True"),
        (L(tp=3, dp=4), L(tp=2, dp=6), r"src dp=4 and dest dp=6 do not divide one another"),
        (
            GridLayout((2, 2, 2), ("tp", "ep", "dp")),
            L(tp=2, dp=4),
            r"axes \['ep=2'\] the bridge does not understand",
        ),
        (
            L(tp=2, dp=4, order=("dp", "tp", "cp", "pp")),
            L(tp=2, cp=2, dp=2),
            r"do not nest: rank 2 has src coords \{'dp': 2, 'tp': 0.*\} and dest coords "
            r"\{'tp': 0, 'cp': 1, 'pp': 0, 'dp': 0\}.*src dp // 2 == dest dp",
        ),
        (
            L(tp=2, dp=2, order=("dp", "tp", "cp", "pp")),
            L(tp=1, cp=2, dp=2),
            r"do not nest: rank 1 .*src dp == dest dp",
        ),
        (
            L(tp=4, dp=2, order=("dp", "tp", "cp", "pp")),
            L(tp=1, cp=2, dp=4),
            r"do not nest: rank 1 .*dest dp // 2 == src dp",
        ),
    ],
)
def test_plan_errors(src, dest, match):
    with pytest.raises(ValueError, match=match):
        plan_bridge(src, dest)


def test_type_and_slice_errors():
    with pytest.raises(TypeError, match="src must be a GridLayout .*from_grid"):
        plan_bridge("tp=2,dp=4", L(tp=2, dp=4))
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, dp=2, cp=2))
    with pytest.raises(ValueError, match="batch_size=3 is not divisible by the bridge scale 2"):
        plan.slice_for(0, 3)
    with pytest.raises(ValueError, match="batch_size=-1"):
        plan.slice_for(0, -1)


# ------------------------------------------------- properties (hypothesis)
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def layout_pairs(draw):
    n = draw(st.integers(1, 16))
    tps = draw(st.sampled_from(_divisors(n)))
    tpd = draw(st.sampled_from(_divisors(n)))
    cpd = draw(st.sampled_from(_divisors(n // tpd)))
    offset = draw(st.sampled_from([0, 3]))
    src = L(tp=tps, dp=n // tps, order=tuple(draw(st.permutations(TCD + ("pp",)))), offset=offset)
    dest = L(
        tp=tpd,
        cp=cpd,
        dp=n // (tpd * cpd),
        order=tuple(draw(st.permutations(TCD + ("pp",)))),
        offset=offset,
    )
    return src, dest


def _samples(layout: GridLayout, rank: int, batch: int) -> list[int]:
    """Brute-force data contract: global samples a rank holds (contiguous DP blocks)."""
    per = batch // layout.axis_size("dp")
    dp = layout.coords(rank)["dp"]
    return list(range(dp * per, (dp + 1) * per))


@settings(max_examples=300, deadline=None)
@given(layout_pairs())
def test_plan_matches_the_data_contract(pair):
    src, dest = pair
    dps, dpd = src.axis_size("dp"), dest.axis_size("dp")
    assume(dps % dpd == 0 or dpd % dps == 0)
    batch = 2 * max(dps, dpd)
    held = {r: (_samples(src, r, batch), _samples(dest, r, batch)) for r in src.ranks}
    # Bridgeable by one gather iff every rank's src samples contain / lie in its dest ones.
    bridgeable = all(set(s) <= set(d) or set(d) <= set(s) for s, d in held.values())
    if not bridgeable:
        with pytest.raises(ValueError, match="do not nest"):
            plan_bridge(src, dest)
        return
    plan = plan_bridge(src, dest)
    k = plan.scale
    assert k == max(dps, dpd) // min(dps, dpd)

    # Every rank in exactly one gather group of `scale` members (single ranks for EQUAL).
    members = [r for g in plan.gather_groups for r in g]
    assert sorted(members) == list(src.ranks)
    assert all(len(g) == k for g in plan.gather_groups)
    # Member order is ascending rank (= process-group rank order of torch groups).
    assert all(list(g) == sorted(g) for g in plan.gather_groups)
    # CP groups partition the ranks into groups of dest cp, sharing dest tp and dp.
    cp_members = sorted(r for g in plan.cp_groups for r in g)
    assert cp_members == list(src.ranks)
    for g in plan.cp_groups:
        assert len(g) == dest.axis_size("cp")
        assert len({(dest.coords(r)["tp"], dest.coords(r)["dp"]) for r in g}) == 1

    for r in src.ranks:
        group = plan.gather_group_of(r)
        s, d = held[r]
        # Slices of the group tile the spanned batch in member order.
        span = len(d) if plan.direction is BridgeDirection.FAN_IN else len(s)
        size = span // k
        assert [plan.slice_for(m, span) for m in group] == [(i * size, size) for i in range(k)]
        if plan.direction is BridgeDirection.FAN_IN:
            # Forward: concatenating the members' src shards gives this rank's dest shard.
            assert [x for m in group for x in held[m][0]] == d
            start, n = plan.slice_for(r, len(d))
            assert d[start : start + n] == s
            assert len({src.coords(m)["tp"] for m in group}) == 1
        elif plan.direction is BridgeDirection.FAN_OUT:
            start, n = plan.slice_for(r, len(s))
            assert s[start : start + n] == d
            # Backward: gathering the members' dest-shard grads rebuilds the src shard grad.
            assert [x for m in group for x in held[m][1]] == s
            assert len({(dest.coords(m)["tp"], dest.coords(m)["cp"]) for m in group}) == 1
        else:
            assert s == d and group == (r,)
