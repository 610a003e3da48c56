"""RowMove (pure): the one plan type of the bridge's row moves, produced by the ragged
gather, the balance plan, the stage delivery and the route; literal rows, and a one-process
simulation of the exchange that checks each move against its plan's own meaning."""

from __future__ import annotations

import torch

from mp_bridge.comm.bridge import (
    MoveLeg,
    RowMove,
    plan_balance,
    plan_bridge,
    plan_stage_delivery,
)
from mp_bridge.comm.bridge.plans import gather_move
from mp_bridge.grid import GridLayout

ORDER = ("tp", "cp", "pp", "dp")


def _simulate(xs: list[torch.Tensor], legs: list[MoveLeg]) -> list[torch.Tensor]:
    """Every member's output of one leg each, the exchange done by hand in one process."""
    out = []
    for me, leg in enumerate(legs):
        y = torch.zeros((leg.dst_rows, *xs[me].shape[1:]), dtype=xs[me].dtype)
        y[leg.keep_dst] = xs[me][leg.keep_src]
        for m, rows in enumerate(leg.recv):
            if len(rows):
                y[rows] = xs[m][legs[m].send[me]]
        out.append(y)
    return out


def _eq(a: torch.Tensor, b) -> bool:
    return a.tolist() == list(b)


def test_gather_move_literal_and_its_inverse_is_the_narrow():
    move = gather_move((2, 1), 1)
    fwd = move.forward
    assert (fwd.src_rows, fwd.dst_rows, fwd.exchange) == (1, 3, True)
    assert _eq(fwd.keep_src, [0]) and _eq(fwd.keep_dst, [2])
    assert [t.tolist() for t in fwd.send] == [[0], []]
    assert [t.tolist() for t in fwd.recv] == [[0, 1], []]
    narrow = move.inverse().forward
    assert (narrow.src_rows, narrow.dst_rows, narrow.exchange) == (3, 1, False)
    assert _eq(narrow.keep_src, [2]) and narrow.send_counts() == [0, 0]
    assert move.inverse().inverse() == move


def test_gather_move_gives_every_member_every_slot():
    slot_rows = (2, 0, 3)
    xs = [torch.arange(n) + 10 * m for m, n in enumerate(slot_rows)]
    ys = _simulate(xs, [gather_move(slot_rows, m).forward for m in range(3)])
    assert all(_eq(y, [0, 1, 20, 21, 22]) for y in ys)


def test_balance_move_delivers_the_plans_images_and_its_backward_returns_them():
    # The balance plan docstring's worked example (c = 0).
    plan = plan_balance([[4, 1, 3], [2], [1, 1]])
    xs = [torch.arange(sum(t)) + 100 * d for d, t in enumerate(plan.tokens)]
    moves = [plan.row_move(d) for d in range(3)]
    ys = _simulate(xs, [m.forward for m in moves])
    assert [len(y) for y in ys] == [sum(plan.tokens_after(d)) for d in range(3)]
    assert _eq(ys[1], [4, 100, 101])  # image 0:1 then 1:0 (source order)
    assert _eq(ys[2], [5, 6, 7, 200, 201])  # image 0:2 then 2:0, 2:1
    assert moves[0].backward == moves[0].forward.reversed()
    back = _simulate(ys, [m.backward for m in moves])
    assert all(torch.equal(b, x) for b, x in zip(back, xs))
    assert moves[0].forward.send_counts() == [0, 1, 3]  # its kept rows stay local
    assert moves[0].forward.covers()


def test_stage_move_gives_each_first_stage_rank_its_llm_batch():
    # encoder tp=2,dp=4 -> LLM tp=2,pp=2,dp=2 (FAN_IN k=2): ranks 2, 3 are stage 1.
    plan = plan_bridge(GridLayout((2, 1, 1, 4), ORDER), GridLayout((2, 1, 2, 2), ORDER),
                       pipeline=True)  # fmt: skip
    sd = plan_stage_delivery(plan)
    src = [plan.src.coords(r)["dp"] for r in range(8)]  # sample block = src dp (1 sample)
    moves = [sd.row_move(r, [1], [1, 1]) for r in range(8)]
    xs = [torch.tensor([float(src[r])]) for r in range(8)]
    ys = _simulate(xs, [m.forward for m in moves])
    for r in range(8):
        d = plan.dest.coords(r)
        want = [2.0 * d["dp"], 2.0 * d["dp"] + 1] if plan.consumes(r) else []
        assert _eq(ys[r], want), r
    grads = _simulate(ys, [m.backward for m in moves])
    assert all(_eq(g, [float(src[r])]) for r, g in enumerate(grads))  # every holder
    assert isinstance(moves[0], RowMove) and moves[2].forward.dst_rows == 0
