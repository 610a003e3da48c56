"""The balance plan (which replica encodes which image) against statements written here.

Properties (hypothesis, up to 9 replicas and 12 images each, some replicas empty): every
image is assigned exactly once and the per-rank splits move exactly those images (a
simulated exchange); the same counts give the same plan whatever the container (TP
peers); Graham's bound ``max ≤ mean + p_max·(m−1)/m``; the maximum falls strictly when
anything moves; nothing moves when the heaviest replica has no image that fits the gap
(equal loads included); cost units and replica labels do not change the plan.
Also the docstring's worked example, literal, and the argument errors.
Tolerance: loads are ``math.fsum`` sums (correctly rounded), so the bounds are checked
with a relative slack of ``1e-12`` of the total cost (a few ulps), never more.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm.bridge.plans.balance_plan import image_costs, plan_balance

replica_tokens = st.lists(
    st.lists(st.integers(1, 40), max_size=12), min_size=1, max_size=9
)  # fmt: skip


def _slack(plan) -> float:
    return 1e-12 * max(math.fsum(plan.loads_before), 1.0)


def test_worked_example_of_the_docstring():
    plan = plan_balance([[4, 1, 3], [2], [1, 1]])
    assert plan.dest == ((0, 1, 2), (1,), (2, 2))
    assert plan.dest_index == ((0, 0, 0), (1,), (1, 2))
    assert plan.loads_before == (26.0, 4.0, 2.0)
    assert plan.loads_after == (16.0, 5.0, 11.0)
    assert [plan.send_rows(r) for r in range(3)] == [(4, 1, 3), (0, 2, 0), (0, 0, 2)]
    assert [plan.recv_rows(r) for r in range(3)] == [(4, 0, 0), (1, 2, 0), (3, 0, 2)]
    assert [plan.tokens_after(r) for r in range(3)] == [(4,), (1, 2), (3, 1, 1)]
    assert plan.moved_images == 2 and plan.moved_rows == 4


def _simulate(plan):
    """Run the exchange by hand: each replica's rows are (replica, row) labels; returns
    what each replica holds after the forward move and after the return move."""
    held = [[(d, i) for i in range(sum(t))] for d, t in enumerate(plan.tokens)]
    msgs = {}  # (src, dest) -> rows
    for d in range(plan.replicas):
        rows = [held[d][i] for i in plan.send_order(d).tolist()]
        start = 0
        for e, n in enumerate(plan.send_rows(d)):
            msgs[d, e], start = rows[start : start + n], start + n
        assert start == len(rows)
    after = [[r for d in range(plan.replicas) for r in msgs[d, e]] for e in range(plan.replicas)]
    back = []
    for d in range(plan.replicas):
        got = [r for e in range(plan.replicas) for r in _split(after[e], plan.recv_rows(e))[d]]
        out = [None] * len(got)
        for pos, i in enumerate(plan.send_order(d).tolist()):
            out[i] = got[pos]
        back.append(out)
    return after, back


def _split(rows, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(rows[start : start + n])
        start += n
    return out


@settings(max_examples=300, deadline=None)
@given(replica_tokens, st.sampled_from([0.0, 1.0, 37.5]))
def test_every_image_is_assigned_once_and_the_splits_move_exactly_it(tokens, c):
    plan = plan_balance(tokens, c=c)
    m = len(tokens)
    # each dest replica's indices are a permutation, ordered by (source, source index)
    for e in range(m):
        mine = sorted((plan.dest_index[d][j], d, j) for d in range(m)
                      for j in range(len(tokens[d])) if plan.dest[d][j] == e)  # fmt: skip
        assert [i for i, _, _ in mine] == list(range(len(mine)))
        assert [(d, j) for _, d, j in mine] == sorted((d, j) for _, d, j in mine)
        assert plan.tokens_after(e) == tuple(tokens[d][j] for _, d, j in mine)
    assert sum(len(plan.tokens_after(e)) for e in range(m)) == sum(len(t) for t in tokens)
    after, back = _simulate(plan)
    for e in range(m):  # replica e holds its images' rows, whole and in its new order
        want = []
        for d in range(m):
            start = 0
            for j, t in enumerate(tokens[d]):
                if plan.dest[d][j] == e:
                    want += [(d, start + i) for i in range(t)]
                start += t
        assert after[e] == want
    assert back == [[(d, i) for i in range(sum(t))] for d, t in enumerate(tokens)]
    crossing = sum(n for e in range(m) for d, n in enumerate(plan.recv_rows(e)) if d != e)
    moved = sum(t for d in range(m) for j, t in enumerate(tokens[d]) if plan.dest[d][j] != d)
    assert crossing == plan.moved_rows == moved


@settings(max_examples=300, deadline=None)
@given(replica_tokens, st.sampled_from([0.0, 3.0]))
def test_cost_bound(tokens, c):
    plan = plan_balance(tokens, c=c)
    costs = [p for r in image_costs(tokens, c=c) for p in r]
    p_max = max(costs, default=0.0)
    m, slack = len(tokens), _slack(plan)
    before, after = plan.loads_before, plan.loads_after
    assert max(after) <= math.fsum(after) / m + p_max * (m - 1) / m + slack  # Graham
    if plan.moved_images:  # every kept move pays for itself
        assert max(after) < max(before)
    else:
        assert after == before
    assert math.isclose(math.fsum(after), math.fsum(before), rel_tol=1e-12)


def test_moves_that_only_even_out_below_a_tied_maximum_are_dropped():
    # loads 25, 52, 52: replica 1 can give 16 to replica 0 (41, 36, 52), but replica 2
    # (images 16 and 36, gap 16) cannot follow, so the maximum stays 52: nothing moves
    plan = plan_balance([[5], [4, 6], [4, 6]])
    assert plan.moved_images == 0 and plan.loads_after == (25.0, 52.0, 52.0)
    # three replicas of ten 1-cost images and one empty: six moves (two from each) reach
    # 8, 8, 8, 6; a seventh (7, 8, 8, 7) would not lower the maximum 8 and is dropped
    plan = plan_balance([[1] * 10, [1] * 10, [1] * 10, []])
    assert plan.loads_after == (8.0, 8.0, 8.0, 6.0) and plan.moved_images == 6
    assert plan.dest[0] == (3, 3) + (0,) * 8 and plan.tokens_after(3) == (1,) * 6


@settings(max_examples=300, deadline=None)
@given(replica_tokens)
def test_nothing_moves_when_no_image_of_the_heaviest_fits_the_gap(tokens):
    costs = image_costs(tokens)
    loads = [math.fsum(r) for r in costs]
    heavy = loads.index(max(loads))  # the lowest index among equals, as the search
    gap = max(loads) - min(loads)
    plan = plan_balance(tokens)
    if not any(0 < p < gap for p in costs[heavy]):
        assert plan.moved_images == 0
        assert plan.dest == tuple((d,) * len(t) for d, t in enumerate(tokens))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), max_size=10), st.integers(1, 8), st.randoms())
def test_equal_loads_move_nothing(images, m, rnd):
    tokens = [rnd.sample(images, len(images)) for _ in range(m)]  # same multiset each
    plan = plan_balance(tokens, c=2.0)
    assert plan.moved_images == 0 and plan.moved_rows == 0
    assert all(plan.send_rows(d)[d] == sum(tokens[d]) for d in range(m))


@settings(max_examples=200, deadline=None)
@given(replica_tokens, st.sampled_from([0.0, 5.0]))
def test_same_counts_same_plan_whatever_the_container(tokens, c):
    a = plan_balance(tokens, c=c)
    b = plan_balance(tuple(tuple(t) for t in tokens), c=c)
    costs = torch.tensor([p for r in image_costs(tokens, c=c) for p in r], dtype=torch.float64)
    d = plan_balance(tokens, cost=costs)  # the measured-cost hook with the same values
    e = plan_balance(tokens, cost=lambda t: t.double() ** 2 + c * t.double())
    assert a == b == plan_balance(tokens, c=c)
    assert a.dest == d.dest == e.dest and a.dest_index == d.dest_index == e.dest_index


@settings(max_examples=200, deadline=None)
@given(replica_tokens, st.sampled_from([0.25, 4.0, 1024.0]))
def test_cost_units_do_not_change_the_plan(tokens, scale):
    costs = torch.tensor([p for r in image_costs(tokens, c=1.0) for p in r], dtype=torch.float64)
    a, b = plan_balance(tokens, cost=costs), plan_balance(tokens, cost=costs * scale)
    assert a.dest == b.dest  # a power-of-two scale is exact in float64


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_relabeling_replicas_relabels_the_plan(data):
    # distinct powers of two: every load and every choice is tie-free, so only the
    # labels can change the plan; every replica holds an image (no tie among empties)
    m = data.draw(st.integers(1, 6))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
    exps = data.draw(st.permutations(range(sum(sizes))))
    costs, start = [], 0
    for n in sizes:
        costs.append([2.0 ** exps[start + i] for i in range(n)])
        start += n
    perm = data.draw(st.permutations(range(m)))  # new label of old replica d: perm[d]
    tokens = [[1] * n for n in sizes]
    flat = torch.tensor([p for r in costs for p in r], dtype=torch.float64)
    inv = sorted(range(m), key=lambda d: perm[d])  # old replica at new label
    flat_p = torch.tensor([p for d in inv for p in costs[d]], dtype=torch.float64)
    a = plan_balance(tokens, cost=flat)
    b = plan_balance([tokens[d] for d in inv], cost=flat_p)
    for d in range(m):
        assert b.dest[perm[d]] == tuple(perm[e] for e in a.dest[d])


@pytest.mark.parametrize(
    "tokens, kwargs, error, match",
    [
        ([[2, 0]], {}, ValueError, r"tokens_per_image\[0\]=\[2, 0\] must hold ints >= 1"),
        ([[2], "ab"], {}, TypeError, r"tokens_per_image\[1\] must be a list of ints"),
        ([], {}, ValueError, "tokens_per_image is empty"),
        (5, {}, TypeError, "tokens_per_image must be a list with one list"),
        ([[2]], {"c": -1.0}, ValueError, r"c=-1.0 must be a finite float >= 0"),
        ([[2, 3]], {"cost": torch.ones(3)}, ValueError, r"cost has shape \(3,\); pass one"),
        ([[2]], {"cost": torch.tensor([-1.0])}, ValueError, "must be finite and >= 0"),
        ([[2]], {"cost": torch.ones(1, dtype=torch.long)}, TypeError, "float tensor"),
        ([[2]], {"cost": "t2"}, TypeError, "cost must be None"),
    ],
)
def test_bad_arguments(tokens, kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_balance(tokens, **kwargs)


def test_one_process_balancer_keeps_its_plans(monkeypatch):
    import mp_bridge.comm.bridge.execution.balancer as balance_module

    calls = []
    real = balance_module.plan_balance
    monkeypatch.setattr(
        balance_module, "plan_balance", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    balancer = balance_module.ImageBalancer(dp_group=None, c=1.0, cache_size=2)
    x = torch.randn(6, 4)
    for counts in ([3, 1, 2], [3, 1, 2], [2, 4], [3, 1, 2], [1, 5], [6], [3, 1, 2]):
        y, plan = balancer.balance(x, counts)
        assert y is x and plan.moved_images == 0 and plan.tokens == (tuple(counts),)
    # an LRU of 2: the repeats of [3, 1, 2] hit until [1, 5] and [6] push it out
    assert [a[0] for a in calls] == [((3, 1, 2),), ((2, 4),), ((1, 5),), ((6,),), ((3, 1, 2),)]
    assert len(balancer.cache) == 2
