"""route_ragged (pure): literal routes, errors, and the data contract over every layout.

The contract is restated here by brute force, independently of the library: the global
ragged batch (B samples, per-sample token counts C) is split over DP in contiguous sample
blocks in both grids; a rank holds, sample-major, the tokens of its block. Tokens are
labelled by their global index, so a route is right when the token lists it implies are
exactly the lists the contract names.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm import BridgeDirection, RaggedRoute, exchange_rows, plan_bridge, route_ragged
from mp_bridge.comm.bridge.plans.token_counts import check_tokens_per_sample
from mp_bridge.grid import GridLayout


def L(tp=1, cp=1, dp=1, *, order=("tp", "cp", "dp")) -> GridLayout:
    sizes = {"tp": tp, "cp": cp, "dp": dp}
    return GridLayout(tuple(sizes[n] for n in order), tuple(order), 0)


# ------------------------------------------------------------ literal routes
def test_fan_in_literal():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2))  # gather groups (0,2),(1,3),...
    route = route_ragged(plan, 2, [(3, 0), (2, 5)])  # rank 2 is slot 1 of (0, 2)
    assert route == RaggedRoute(BridgeDirection.FAN_IN, 1, (3, 7), (3, 0, 2, 5))
    assert route.own_range == (3, 10) and route.total_tokens == 10
    assert route.exchanged_tokens == 3  # rank 2 receives rank 0's 3 tokens


def test_fan_out_literal():
    plan = plan_bridge(L(tp=4, dp=2), L(tp=1, cp=2, dp=4))  # rank 3: slot 1 of (1, 3)
    route = route_ragged(plan, 3, [(3, 0, 2, 5)] * 2)
    assert route == RaggedRoute(BridgeDirection.FAN_OUT, 1, (3, 7), (2, 5))
    assert route.own_range == (3, 10) and route.exchanged_tokens == 3


def test_equal_and_all_zero_rank():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=1, cp=2, dp=4))
    route = route_ragged(plan, 5, [(0, 0, 0)])
    assert route == RaggedRoute(BridgeDirection.EQUAL, 0, (0,), (0, 0, 0))
    assert route.own_range == (0, 0) and route.exchanged_tokens == 0


def test_fan_in_k8_with_empty_members():
    plan = plan_bridge(L(dp=8), L(tp=8))
    counts = [(), (), (), (), (), (), (), ()]  # zero samples per rank is a valid batch
    assert route_ragged(plan, 4, counts).dest_counts == ()
    counts = [(0,), (4,), (0,), (0,), (1,), (0,), (0,), (9,)]
    route = route_ragged(plan, 7, counts)
    assert route.slot_tokens == (0, 4, 0, 0, 1, 0, 0, 9) and route.own_range == (5, 14)


# ------------------------------------------------------------------ errors
def test_members_with_different_sample_counts():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2))
    with pytest.raises(ValueError, match=r"gather group \[0, 2\] .*rank 0: 2, rank 2: 3"):
        route_ragged(plan, 0, [(1, 2), (1, 2, 3)])


def test_negative_or_non_int_counts():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2))
    with pytest.raises(ValueError, match=r"member_counts\[1\]=\[1, -2\] .*\[-2\].*>= 0"):
        route_ragged(plan, 0, [(1, 2), (1, -2)])
    with pytest.raises(ValueError, match=r"not non-negative ints"):
        route_ragged(plan, 0, [(1, 2.0), (1, 2)])


def test_fan_out_batch_not_divisible_and_unequal_members():
    plan = plan_bridge(L(tp=4, dp=2), L(tp=1, cp=2, dp=4))
    with pytest.raises(ValueError, match=r"3 samples .*scale 2 .*divisible by 2"):
        route_ragged(plan, 3, [(1, 2, 3)] * 2)
    with pytest.raises(ValueError, match=r"same src batch, so their counts must be equal"):
        route_ragged(plan, 3, [(1, 2), (2, 1)])


def test_wrong_number_of_members():
    plan = plan_bridge(L(tp=2, dp=4), L(tp=2, cp=2, dp=2))
    with pytest.raises(ValueError, match=r"has 1 entries .* \[0, 2\] has 2 members"):
        route_ragged(plan, 0, [(1, 2)])


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([1, -1, 2], ValueError, r"negative counts \[-1\]"),
        ([1, 1], ValueError, r"sums to 2 but x has 3 tokens"),
        ([1.0, 2.0], ValueError, r"non-int entries"),
        ([[1, 2]], ValueError, r"non-int entries"),
        (3, TypeError, r"1-D integer tensor or a sequence of ints, got int"),
    ],
)
def test_check_tokens_per_sample_sequences(value, error, match):
    with pytest.raises(error, match=match):
        check_tokens_per_sample(value, 3)


def test_check_tokens_per_sample_tensors():
    assert check_tokens_per_sample(torch.tensor([0, 3], dtype=torch.int32), 3) == (0, 3)
    with pytest.raises(ValueError, match=r"dtype torch.float32; pass an integer tensor"):
        check_tokens_per_sample(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match=r"dtype torch.bool"):
        check_tokens_per_sample(torch.tensor([True]), 1)
    with pytest.raises(ValueError, match=r"shape \(1, 2\) \(2 dims\); pass a 1-D"):
        check_tokens_per_sample(torch.tensor([[1, 2]]), 3)
    with pytest.raises(ValueError, match=r"shape \(\) \(0 dims\)"):
        check_tokens_per_sample(torch.tensor(3), 3)


# --------------------------------------------- brute-force contract, every layout
def _factorisations(w: int, n: int) -> list[tuple[int, ...]]:
    if n == 1:
        return [(w,)]
    return [(a, *r) for a in range(1, w + 1) if w % a == 0 for r in _factorisations(w // a, n - 1)]


@functools.cache
def _bridgeable_layouts() -> list[tuple[GridLayout, GridLayout]]:
    """Every (src tp×dp, dest tp×cp×dp) pair on <= 16 ranks, every dim order, that nests."""
    out = []
    for world in range(1, 17):
        for src_order in itertools.permutations(("tp", "dp")):
            for tp, dp in _factorisations(world, 2):
                src = GridLayout(tuple({"tp": tp, "dp": dp}[n] for n in src_order), src_order)
                for dest_order in itertools.permutations(("tp", "cp", "dp")):
                    for t, c, d in _factorisations(world, 3):
                        sizes = {"tp": t, "cp": c, "dp": d}
                        dest = GridLayout(tuple(sizes[n] for n in dest_order), dest_order)
                        try:
                            plan_bridge(src, dest)
                        except ValueError:  # does not nest: not bridgeable by one gather
                            continue
                        out.append((src, dest))
    return out


def _block(layout: GridLayout, rank: int, batch: int) -> range:
    """Contract: samples of ``rank`` = contiguous block number dp of batch/DP samples."""
    per = batch // layout.axis_size("dp")
    dp = layout.coords(rank)["dp"]
    return range(dp * per, (dp + 1) * per)


def _tokens(samples: range, counts: list[int]) -> list[int]:
    """Global token ids of ``samples``, sample-major."""
    starts = list(itertools.accumulate([0, *counts]))
    return [t for s in samples for t in range(starts[s], starts[s + 1])]


def _pieces(tokens: list[int], slot_tokens: tuple[int, ...]) -> list[list[int]]:
    starts = list(itertools.accumulate([0, *slot_tokens]))
    assert starts[-1] == len(tokens), (starts, len(tokens))
    return [tokens[a:b] for a, b in zip(starts, starts[1:])]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_routes_match_the_data_contract(data):
    src, dest = data.draw(st.sampled_from(_bridgeable_layouts()))
    plan = plan_bridge(src, dest)
    dps, dpd = src.axis_size("dp"), dest.axis_size("dp")
    batch = math.lcm(dps, dpd) * data.draw(st.integers(0, 3))
    counts = data.draw(st.lists(st.integers(0, 5), min_size=batch, max_size=batch))
    if batch and data.draw(st.booleans()):  # one src rank holds only text-only samples
        ds = data.draw(st.integers(0, dps - 1))
        for s in range(ds * batch // dps, (ds + 1) * batch // dps):
            counts[s] = 0
    for rank in src.ranks:
        src_tok = _tokens(_block(src, rank, batch), counts)
        dest_tok = _tokens(_block(dest, rank, batch), counts)
        members = plan.gather_group_of(rank)
        member_counts = [
            [counts[s] for s in _block(src, m, batch)]
            for m in (
                members if plan.direction is BridgeDirection.FAN_IN else [rank] * len(members)
            )
        ]
        route = route_ragged(plan, rank, member_counts)
        assert list(route.dest_counts) == [counts[s] for s in _block(dest, rank, batch)]
        a, b = route.own_range
        if plan.direction is BridgeDirection.FAN_IN:
            # Forward: slot m of the dest batch is member m's src tokens; backward keeps
            # own_range, which must be exactly this rank's src tokens.
            pieces = _pieces(dest_tok, route.slot_tokens)
            for m, piece in zip(members, pieces):
                assert piece == _tokens(_block(src, m, batch), counts)
            assert dest_tok[a:b] == src_tok
        elif plan.direction is BridgeDirection.FAN_OUT:
            # Forward keeps own_range of the src tokens; backward puts member m's dest
            # gradient at slot m, which must be member m's dest tokens.
            assert src_tok[a:b] == dest_tok
            for m, piece in zip(members, _pieces(src_tok, route.slot_tokens)):
                assert piece == _tokens(_block(dest, m, batch), counts)
        else:
            assert src_tok == dest_tok and route.slot_tokens == (len(src_tok),)
            assert (a, b) == (0, len(src_tok))
        assert route.exchanged_tokens == route.total_tokens - (b - a)


def test_exchange_rows_single_process_and_bad_slot_rows():
    x = torch.arange(6.0).reshape(3, 2)
    y, got = exchange_rows(x, None, (3,), torch.tensor([1, 2]))
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert got.tolist() == [[1, 2]]
    with pytest.raises(ValueError, match=r"slot_rows=\[2\] .*x.shape\[0\]=3"):
        exchange_rows(x, None, (2,))
    with pytest.raises(ValueError, match=r"slot_rows=\[3, 3\] must hold one row count per"):
        exchange_rows(x, None, (3, 3))
