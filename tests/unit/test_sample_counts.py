"""The count check of ``route`` (no process group): rows, comparison and message.

Each test builds every rank's row with ``count_row`` (what the all-gather would deliver)
and checks ``counts_agree`` and ``count_mismatch_message`` against hand-written
expectations: the bad sample named by its LLM replica, its index there, its global index
and its encoder replica; TP peers that disagree; a swap of two samples' counts (same
totals) detected. A hypothesis test compares ``counts_agree`` with the plain statement
(replica peers pass equal lists; the encoder lists, concatenated in DP order, equal the
LLM lists) on random layouts and perturbations.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm.bridge.execution.sample_counts import check_sample_counts
from mp_bridge.comm.bridge.plans.bridge_plan import plan_bridge
from mp_bridge.comm.bridge.plans.count_rows import (
    PRIME,
    count_mismatch_message,
    count_row,
    counts_agree,
    counts_fingerprint,
)
from mp_bridge.grid import GridLayout

ORDER = ("tp", "cp", "pp", "dp")
WHERE = "route"


def _plan(src, dest):
    return plan_bridge(GridLayout(src, ORDER), GridLayout(dest, ORDER))


# FAN_IN k=2 on 8 ranks: encoder tp=2,dp=4 (2 samples each), LLM tp=2,cp=2,dp=2 (4 each).
FAN_IN = _plan((2, 1, 1, 4), (2, 2, 1, 2))
GLOBAL = [3, 0, 5, 2, 7, 1, 4, 6]  # image tokens of global samples 0..7


def _per_rank(plan, counts, *, n_src, n_dest, llm=None):
    """Each rank's (encoder counts, llm counts) under the contiguous-block data contract
    (``llm``: the LLM side's global counts when they differ from ``counts``)."""
    llm = counts if llm is None else llm
    out = {}
    for r in plan.src.ranks:
        s, d = plan.src.coords(r)["dp"], plan.dest.coords(r)["dp"]
        out[r] = (counts[s * n_src : (s + 1) * n_src], llm[d * n_dest : (d + 1) * n_dest])
    return out


def _rows(per_rank):
    return [count_row(r, e, m) for r, (e, m) in sorted(per_rank.items())]


def test_fingerprint_values_order_and_additivity():
    assert counts_fingerprint([]) == 0
    assert counts_fingerprint([1, 2]) == 1 + 2 * 37
    assert counts_fingerprint([3], first=2) == 3 * 37**2
    assert counts_fingerprint([2, 1]) != counts_fingerprint([1, 2])
    whole = counts_fingerprint([4, 0, 9, 1])
    assert whole == (counts_fingerprint([4, 0]) + counts_fingerprint([9, 1], first=2)) % PRIME


def test_matching_counts_agree():
    per_rank = _per_rank(FAN_IN, GLOBAL, n_src=2, n_dest=4)
    assert counts_agree(FAN_IN, _rows(per_rank))


def test_a_mismatching_sample_is_named():
    per_rank = _per_rank(FAN_IN, GLOBAL, n_src=2, n_dest=4)
    for r in range(4, 8):  # LLM replica 1 (ranks 4-7): its sample 1 (global 5) has 4
        enc, llm = per_rank[r]
        per_rank[r] = (enc, llm[:1] + [4] + llm[2:])
    assert not counts_agree(FAN_IN, _rows(per_rank))
    msg = count_mismatch_message(FAN_IN, per_rank, WHERE)
    assert msg.startswith("route: image_mask and tokens_per_sample disagree on 1 sample(s): ")
    assert (
        "sample 1 of LLM DP replica 1 has 4 True entries in image_mask but 1 image tokens in "
        "tokens_per_sample (global sample 5; sample 1 of encoder DP replica 2)"
    ) in msg


def test_tp_peers_that_disagree_are_named():
    per_rank = _per_rank(FAN_IN, GLOBAL, n_src=2, n_dest=4)
    enc, llm = per_rank[1]  # LLM tp rank 1 of replica 0 swaps samples 2 and 3 (same total)
    per_rank[1] = (enc, [llm[0], llm[1], llm[3], llm[2]])
    assert not counts_agree(FAN_IN, _rows(per_rank))
    msg = count_mismatch_message(FAN_IN, per_rank, WHERE)
    assert (
        "the ranks [0, 1, 2, 3] of LLM DP replica 0 disagree on image_mask: its sample 2 has "
        "5 on rank 0 but 2 on rank 1"
    ) in msg


def test_encoder_tp_peers_that_disagree_are_named():
    per_rank = _per_rank(FAN_IN, GLOBAL, n_src=2, n_dest=4)
    per_rank[5] = ([7, 1, 0], per_rank[5][1])  # encoder replica 2 = ranks 4, 5
    assert not counts_agree(FAN_IN, _rows(per_rank))
    msg = count_mismatch_message(FAN_IN, per_rank, WHERE)
    assert (
        "the ranks [4, 5] of encoder DP replica 2 disagree on tokens_per_sample: rank 4 passes "
        "2 samples, rank 5 3"
    ) in msg


@pytest.mark.parametrize("side", ["encoder", "llm"])
def test_swapping_two_samples_counts_is_detected(side):
    # Samples 1 and 2 (different encoder replicas, one LLM replica) swap their counts on
    # one side only: every size and total is unchanged; only the fingerprint sees it.
    swapped = GLOBAL[:1] + [GLOBAL[2], GLOBAL[1]] + GLOBAL[3:]
    enc, llm = (swapped, GLOBAL) if side == "encoder" else (GLOBAL, swapped)
    per_rank = _per_rank(FAN_IN, enc, n_src=2, n_dest=4, llm=llm)
    assert not counts_agree(FAN_IN, _rows(per_rank))
    msg = count_mismatch_message(FAN_IN, per_rank, WHERE)
    assert "disagree on 2 sample(s): sample 1 of LLM DP replica 0 has" in msg
    assert "(global sample 1; sample 1 of encoder DP replica 0)" in msg
    assert "(global sample 2; sample 0 of encoder DP replica 1)" in msg


def test_a_wrong_number_of_samples_is_named():
    # Encoder tp=1, dp=8 -> LLM tp=4, dp=2 (FAN_IN k=4): rank 5 passes 2 samples, not 1.
    plan = _plan((1, 1, 1, 8), (4, 1, 1, 2))
    per_rank = _per_rank(plan, GLOBAL, n_src=1, n_dest=4)
    per_rank[5] = ([1, 0], per_rank[5][1])
    assert not counts_agree(plan, _rows(per_rank))
    msg = count_mismatch_message(plan, per_rank, WHERE)
    assert "samples per DP batch do not fit FAN_IN with scale 4: encoder DP replica 4" in msg
    assert "replica 5 (ranks [5]) 2, replica 6 (ranks [6]) 1" in msg


def test_single_process_check_raises_without_a_group():
    plan = _plan((1, 1, 1, 1), (1, 1, 1, 1))
    rows = check_sample_counts(plan, 0, None, encoder_counts=[2, 3], llm_counts=[2, 3])
    assert [r.rank for r in rows] == [0]
    with pytest.raises(ValueError, match=r"sample 1 of LLM DP replica 0 has 4 True entries"):
        check_sample_counts(plan, 0, None, encoder_counts=[2, 3], llm_counts=[2, 4])


LAYOUTS = [  # (src, dest) on 1-8 ranks: FAN_IN, FAN_OUT and EQUAL, with TP/CP peers
    ((1, 1, 1, 1), (1, 1, 1, 1)),
    ((2, 1, 1, 4), (2, 2, 1, 2)),
    ((1, 1, 1, 8), (4, 1, 1, 2)),
    ((4, 1, 1, 2), (1, 2, 1, 4)),
    ((8, 1, 1, 1), (2, 2, 1, 2)),
    ((2, 1, 1, 4), (2, 1, 1, 4)),
    ((3, 1, 1, 2), (1, 3, 1, 2)),
    ((1, 1, 1, 6), (2, 3, 1, 1)),
]


@settings(max_examples=200, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    per=st.integers(1, 2),
    data=st.data(),
)
def test_counts_agree_is_the_plain_statement(layout, per, data):
    plan = _plan(*layout)
    n = per * max(layout[0][3], layout[1][3])
    counts = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    per_rank = _per_rank(plan, counts, n_src=n // layout[0][3], n_dest=n // layout[1][3])
    ranks = list(plan.src.ranks)
    for _ in range(data.draw(st.integers(0, 2))):  # perturb some ranks' lists
        r = data.draw(st.sampled_from(ranks))
        side = data.draw(st.integers(0, 1))
        lst = list(per_rank[r][side])
        how = data.draw(st.sampled_from(["change", "swap", "append", "drop"]))
        if how == "change" and lst:
            i = data.draw(st.integers(0, len(lst) - 1))
            lst[i] = data.draw(st.integers(0, 3))
        elif how == "swap" and len(lst) > 1:
            i, j = data.draw(st.integers(0, len(lst) - 1)), data.draw(st.integers(0, len(lst) - 1))
            lst[i], lst[j] = lst[j], lst[i]
        elif how == "append":
            lst.append(data.draw(st.integers(0, 3)))
        elif lst:
            lst.pop()
        if data.draw(st.booleans()):  # the whole replica, else this rank alone
            layout_side = plan.src if side == 0 else plan.dest
            dp = layout_side.coords(r)["dp"]
            peers = [q for q in ranks if layout_side.coords(q)["dp"] == dp]
        else:
            peers = [r]
        for q in peers:
            pair = list(per_rank[q])
            pair[side] = lst
            per_rank[q] = tuple(pair)

    # The plain statement: replica peers pass equal lists, and per route group (an LLM
    # replica for FAN_IN/EQUAL, an encoder replica for FAN_OUT: the side with fewer
    # replicas) the encoder replicas have equal sizes, the LLM replicas too, and the
    # encoder lists concatenated in DP order equal the LLM lists concatenated.
    def lists(layout_side, side):
        out = {}
        for r in ranks:
            out.setdefault(layout_side.coords(r)["dp"], set()).add(tuple(per_rank[r][side]))
        return out

    enc, llm = lists(plan.src, 0), lists(plan.dest, 1)
    want = all(len(v) == 1 for v in [*enc.values(), *llm.values()])
    if want:
        enc = {d: next(iter(v)) for d, v in enc.items()}
        llm = {d: next(iter(v)) for d, v in llm.items()}
        by_src = layout[0][3] <= layout[1][3]
        groups = {}
        for r in ranks:
            key = (plan.src if by_src else plan.dest).coords(r)["dp"]
            e, m = groups.setdefault(key, (set(), set()))
            e.add(plan.src.coords(r)["dp"])
            m.add(plan.dest.coords(r)["dp"])
        for e, m in groups.values():
            e_lists, m_lists = [enc[d] for d in sorted(e)], [llm[d] for d in sorted(m)]
            want = want and len({len(x) for x in e_lists}) == 1
            want = want and len({len(x) for x in m_lists}) == 1
            want = want and [c for x in e_lists for c in x] == [c for x in m_lists for c in x]
    assert counts_agree(plan, _rows(per_rank)) == want
    if not want:
        msg = count_mismatch_message(plan, per_rank, WHERE)
        assert "fingerprints differ but the counts agree" not in msg, msg
