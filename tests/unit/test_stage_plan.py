"""plan_bridge with a pipelined LLM (dest PP > 1) and the stage delivery plan (pure)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mp_bridge.comm.bridge import (
    BridgeDirection,
    Piece,
    plan_bridge,
    plan_stage_delivery,
    route_needs,
)
from mp_bridge.grid import GridLayout

ORDER = ("tp", "cp", "pp", "dp")


def L(tp=1, cp=1, pp=1, dp=1, *, order=ORDER) -> GridLayout:
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    return GridLayout(tuple(sizes[n] for n in order), tuple(order))


P = Piece


# ------------------------------------------------------------ literal plans
def test_tp2_dp4_to_tp2_pp2_dp2():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, pp=2, dp=2), pipeline=True)
    assert plan.direction is BridgeDirection.FAN_IN and plan.scale == 2 and plan.pp_size == 2
    assert [plan.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    sd = plan_stage_delivery(plan)
    assert sd.consumed(0) == (P(0, 0), P(1, 0)) and sd.consumed(2) == ()
    # Piece (1, 0) lives on ranks 2, 3 (stage 1); consumers 0, 1 take one TP replica each.
    assert sd.receives(0) == {2: (P(1, 0),)} and sd.receives(1) == {3: (P(1, 0),)}
    assert sd.sends(2) == {0: (P(1, 0),)} and sd.receives(2) == {}
    assert sd.receives(2, backward=True) == {0: (P(1, 0),)}
    assert sd.receives(0, backward=True) == {}  # consumed its own piece: keeps the grad
    assert [sd.receives(r) for r in (4, 5)] == [{6: (P(3, 1),)}, {7: (P(3, 1),)}]


def test_tp1_dp8_to_tp1_cp2_pp2_dp2():
    plan = plan_bridge(L(tp=1, dp=8), L(tp=1, cp=2, pp=2, dp=2), pipeline=True)
    assert plan.direction is BridgeDirection.FAN_IN and plan.scale == 4
    assert [r for r in range(8) if plan.consumes(r)] == [0, 1, 4, 5]
    sd = plan_stage_delivery(plan)
    assert sd.receives(0) == {1: (P(1, 0),), 2: (P(2, 0),), 3: (P(3, 0),)}
    assert sd.receives(1) == {0: (P(0, 0),), 2: (P(2, 0),), 3: (P(3, 0),)}
    assert sd.sends(2) == {0: (P(2, 0),), 1: (P(2, 0),)}  # each CP shard needs the sample
    assert sd.receives(3) == {} and sd.receives(3, backward=True) == {0: (P(3, 0),)}
    assert sd.receives(6, backward=True) == {4: (P(6, 1),)}


def test_tp2_dp4_to_tp2_pp4_dp1():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, pp=4, dp=1), pipeline=True)
    assert plan.direction is BridgeDirection.FAN_IN and plan.scale == 4
    sd = plan_stage_delivery(plan)
    assert [plan.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sd.receives(0) == {2: (P(1, 0),), 4: (P(2, 0),), 6: (P(3, 0),)}
    assert sd.receives(1) == {3: (P(1, 0),), 5: (P(2, 0),), 7: (P(3, 0),)}
    assert all(sd.receives(r) == {} for r in range(2, 8))
    assert sd.receives(7, backward=True) == {1: (P(3, 0),)}


def test_equal_and_fan_out_move_gradients_only():
    eq = plan_stage_delivery(plan_bridge(L(tp=4, dp=2), L(tp=2, pp=2, dp=2), pipeline=True))
    assert eq.plan.direction is BridgeDirection.EQUAL and eq.forward == ()
    assert eq.receives(2, backward=True) == {0: (P(0, 0),)}
    fo = plan_stage_delivery(plan_bridge(L(tp=8, dp=1), L(tp=2, pp=2, dp=2), pipeline=True))
    assert fo.plan.direction is BridgeDirection.FAN_OUT and fo.forward == ()
    # Every encoder rank needs the whole src batch's gradient: pieces (0,0) and (0,1).
    assert fo.receives(2, backward=True) == {0: (P(0, 0),), 4: (P(0, 1),)}
    assert fo.receives(0, backward=True) == {4: (P(0, 1),)}


def test_axis_order_pp_first_nests():
    dest = L(tp=2, pp=2, dp=2, order=("pp", "tp", "cp", "dp"))
    plan = plan_bridge(L(tp=2, dp=4), dest, pipeline=True)
    assert [r for r in range(8) if plan.consumes(r)] == [0, 2, 4, 6]


def test_piece_rows_ragged():
    sd = plan_stage_delivery(plan_bridge(L(tp=2, dp=4), L(tp=2, pp=2, dp=2), pipeline=True))
    assert sd.piece_rows(0, P(1, 0), (3, 0, 2, 5), side="dest") == (3, 10)
    assert sd.piece_rows(2, P(1, 0), (2, 5), side="src") == (0, 7)
    with pytest.raises(ValueError, match=r"Piece\(2,1\) is not in rank 0's dest batch"):
        sd.piece_rows(0, P(2, 1), (1, 1), side="dest")
    with pytest.raises(ValueError, match="3 samples .* 2 equal pieces"):
        sd.piece_rows(0, P(0, 0), (1, 1, 1), side="dest")


def test_route_needs_later_stage_needs_nothing():
    import torch

    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, pp=2, dp=2), pipeline=True)
    shards = torch.tensor([0, 0, 0])  # three image tokens, one shard (cp 1, no SP)
    holds, needs = route_needs(
        plan, (0, 1, 2, 3), pieces=1, src_totals={0: 1, 1: 2}, dest_shards={0: shards}
    )
    assert holds == [(0, 1), (0, 1), (1, 3), (1, 3)]
    assert [n.tolist() for n in needs] == [[0, 1, 2], [0, 1, 2], [], []]


@pytest.mark.parametrize(
    ("src", "dest", "pieces"),
    [
        (L(tp=2, dp=4), L(tp=2, pp=2, dp=2), 1),
        (L(tp=2, dp=4), L(tp=2, pp=2, dp=2), 2),  # SP: each TP rank its own piece
        (L(tp=1, dp=8), L(tp=1, cp=2, pp=2, dp=2), 1),
        (L(tp=2, dp=4), L(tp=2, pp=4, dp=1), 1),
    ],
)
def test_route_targets_the_first_stage_at_the_byte_bound(src, dest, pieces):
    """route_needs + plan_route with PP: a later stage receives no row; a first-stage rank
    receives exactly the rows of its shard it does not hold; every holder gets each held
    row's gradient once (its own consumption or one message)."""
    import torch

    from mp_bridge.comm.bridge import plan_route, route_groups

    plan = plan_bridge(src, dest, pipeline=True)
    cp = dest.axis_size("cp")
    for members in route_groups(plan):
        s_dps = sorted({src.coords(m)["dp"] for m in members})
        d_dps = sorted({dest.coords(m)["dp"] for m in members})
        src_totals = {d: 3 + d for d in s_dps}  # uneven image tokens per encoder replica
        total = sum(src_totals.values())
        # one LLM replica here (FAN_IN): tokens spread round-robin over its shards
        assert len(d_dps) == 1
        dest_shards = {d_dps[0]: torch.arange(total) % (cp * pieces)}
        holds, needs = route_needs(
            plan, members, pieces=pieces, src_totals=src_totals, dest_shards=dest_shards
        )
        routes = [plan_route(members, r, holds, needs) for r in members]
        for i, (r, route) in enumerate(zip(members, routes)):
            got = sum(route.fwd_rows()[1])
            if not plan.consumes(r):
                assert route.n_local == 0 and got == 0
                continue
            held = ((needs[i] >= holds[i][0]) & (needs[i] < holds[i][1])).sum()
            assert got == len(needs[i]) - int(held)
            # a first-stage rank's rows come only from holders that have them
            for j, n in enumerate(route.recv_y):
                assert len(n) == 0 or holds[j][1] > holds[j][0]
        for i, route in enumerate(routes):  # backward: each held row's gradient once
            a, b = holds[i]
            own = sum(int(((n >= a) & (n < b)).sum()) for n in needs[i : i + 1])
            assert sum(route.bwd_rows()[1]) + own == b - a


# ------------------------------------------------------------- error paths
@pytest.mark.parametrize(
    ("src", "dest", "match"),
    [
        (L(tp=2, pp=2, dp=2), L(tp=2, dp=4), r"src grid .* has pp=2; .*src pp=1 only.*pp axis"),
        (
            L(tp=2, dp=4),
            L(tp=2, pp=2, dp=2, order=("dp", "tp", "cp", "pp")),
            r"do not nest: rank 1 .*dest coords \{'dp': 1.*src dp // 2 == dest dp.*'pp', 'dp'",
        ),
        (L(tp=2, dp=4), L(tp=1, pp=3, dp=3, order=ORDER), r"covers ranks \[0, 8\) .* \[0, 9\)"),
    ],
)
def test_pp_errors(src, dest, match):
    with pytest.raises(ValueError, match=match):
        plan_bridge(src, dest, pipeline=True)


def test_dest_pp_needs_a_pipeline_caller():
    with pytest.raises(ValueError, match=r"dest grid .* has pp=2; .*pass pipeline=True"):
        plan_bridge(L(tp=2, dp=4), L(tp=2, pp=2, dp=2))
    with pytest.raises(TypeError, match="pipeline must be True or False"):
        plan_bridge(L(tp=2, dp=4), L(tp=2, dp=4), pipeline=1)


def test_stage_delivery_needs_a_plan():
    with pytest.raises(TypeError, match="plan must be a BridgePlan"):
        plan_stage_delivery("tp=2")


# -------------------------------------------------------------- properties
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def pp_pairs(draw):
    n = draw(st.integers(2, 16))
    tps = draw(st.sampled_from(_divisors(n)))
    pp = draw(st.sampled_from([d for d in _divisors(n) if d > 1] or [1]))
    tpd = draw(st.sampled_from(_divisors(n // pp)))
    cpd = draw(st.sampled_from(_divisors(n // (pp * tpd))))
    src = L(tp=tps, dp=n // tps, order=tuple(draw(st.permutations(ORDER))))
    dest = L(tp=tpd, cp=cpd, pp=pp, dp=n // (pp * tpd * cpd), order=draw(st.permutations(ORDER)))
    return src, dest


@settings(max_examples=300, deadline=None)
@given(pp_pairs())
def test_every_piece_reaches_each_first_stage_consumer_once(pair):
    src, dest = pair
    try:
        plan = plan_bridge(src, dest, pipeline=True)
    except ValueError as exc:
        assume(False)
        raise AssertionError from exc  # unreachable
    sd = plan_stage_delivery(plan)
    batch = 2 * max(src.axis_size("dp"), dest.axis_size("dp"))

    def samples(layout, r):  # brute-force data contract: contiguous DP blocks
        per = batch // layout.axis_size("dp")
        dp = layout.coords(r)["dp"]
        return set(range(dp * per, (dp + 1) * per))

    for r in src.ranks:
        stage = dest.coords(r)["pp"] if "pp" in dest.axis_names else 0
        got = sd.receives(r)
        if stage > 0:
            assert got == {} and sd.consumed(r) == ()
            continue
        # Forward: every sample of r's LLM batch is held or received exactly once, and
        # each sender holds what it sends.
        have = [
            s for p in sd.src_pieces(r) if p in sd.consumed(r) for s in _piece(p, src, dest, batch)
        ]
        for sender, pieces in got.items():
            for p in pieces:
                assert _piece(p, src, dest, batch) <= samples(src, sender)
                have += sorted(_piece(p, src, dest, batch))
        assert sorted(have) == sorted(samples(dest, r))
    # Backward: every rank ends with the gradient of its whole encoder batch, once per row.
    for r in src.ranks:
        own = [
            s for p in sd.src_pieces(r) if p in sd.consumed(r) for s in _piece(p, src, dest, batch)
        ]
        for sender, pieces in sd.receives(r, backward=True).items():
            assert plan.consumes(sender)
            for p in pieces:
                assert p in sd.consumed(sender)
                own += sorted(_piece(p, src, dest, batch))
        assert sorted(own) == sorted(samples(src, r))


def _piece(p: Piece, src: GridLayout, dest: GridLayout, batch: int) -> set[int]:
    """Samples of piece ``p``: its src DP block intersected with its dest DP block."""
    per_s, per_d = batch // src.axis_size("dp"), batch // dest.axis_size("dp")
    block_s = set(range(p.src_dp * per_s, (p.src_dp + 1) * per_s))
    return block_s & set(range(p.dest_dp * per_d, (p.dest_dp + 1) * per_d))
