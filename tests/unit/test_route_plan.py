"""The route plan (who sends which image rows to whom) against a brute-force statement.

For every layout pair of up to 16 ranks (hypothesis), CP/SP, plain or packed batches with
random lengths and random image positions: simulating every member's messages, each
rank ends with exactly the (sample, token) pairs of the image positions of its local
shard, in shard order (the shard is ``ref_local_tokens``, an independent cut); every
encoder rank gets each of its rows' gradients exactly once, from a rank that consumed
that row; the forward bytes are exactly the rows a rank needs and does not hold.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm.bridge.plans.bridge_plan import plan_bridge
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.bridge.plans.route import (
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from mp_bridge.comm.sequence.padding import pad_layout
from mp_bridge.grid import GridLayout
from tests.functional.route_oracle import ref_local_tokens

ORDER = ("tp", "cp", "pp", "dp")


def _layouts():
    out = []
    for world in range(1, 17):
        for tp_s in (t for t in range(1, world + 1) if world % t == 0):
            for tp_d, cp_d in itertools.product(range(1, world + 1), repeat=2):
                if world % (tp_d * cp_d):
                    continue
                dp_s, dp_d = world // tp_s, world // (tp_d * cp_d)
                if dp_s % dp_d and dp_d % dp_s:
                    continue
                out.append(((tp_s, 1, 1, dp_s), (tp_d, cp_d, 1, dp_d)))
    return out


LAYOUTS = _layouts()


@st.composite
def scenarios(draw):
    src, dest = draw(st.sampled_from(LAYOUTS))
    sp = draw(st.booleans())
    packed = draw(st.booleans())
    dp_s, dp_d = src[3], dest[3]
    n = max(dp_s, dp_d) * draw(st.integers(1, 2))
    plain_len = draw(st.integers(0, 13))
    lengths = [draw(st.integers(0, 9)) if packed else plain_len for _ in range(n)]
    positions = [sorted(draw(st.sets(st.integers(0, max(L - 1, 0)), max_size=L))) for L in lengths]
    return src, dest, sp, packed, lengths, positions


def _replica_mask(lengths, positions, samples, packed):
    rows = []
    for s in samples:
        m = torch.zeros(lengths[s], dtype=torch.bool)
        m[positions[s]] = True
        rows.append(m)
    if packed:
        cu = list(itertools.accumulate([0, *(lengths[s] for s in samples)]))
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.bool), cu
    return torch.stack(rows), None


@settings(max_examples=50, deadline=None)
@given(scenarios())
def test_every_rank_holds_exactly_its_shards_image_tokens(scenario):
    src, dest, sp, packed, lengths, positions = scenario
    s_lay, d_lay = GridLayout(src, ORDER), GridLayout(dest, ORDER)
    plan = plan_bridge(s_lay, d_lay)
    tp, cp = dest[0], dest[1]
    pieces = tp if sp and tp > 1 else 1
    per_s, per_d = len(lengths) // src[3], len(lengths) // dest[3]
    counts = [len(p) for p in positions]

    for members in route_groups(plan):
        s_dps = sorted({s_lay.coords(m)["dp"] for m in members})
        d_dps = sorted({d_lay.coords(m)["dp"] for m in members})
        samples = range(min(s_dps[0] * per_s, d_dps[0] * per_d), len(lengths))
        samples = range(samples.start, samples.start + max(len(s_dps) * per_s, len(d_dps) * per_d))
        g_start = {s: sum(counts[samples.start : s]) for s in samples}  # group batch order
        dest_shards = {}
        for d in d_dps:
            ss = range(d * per_d, (d + 1) * per_d)
            mask, cu = _replica_mask(lengths, positions, ss, packed)
            seq = mask.shape[-1]
            layout = pad_layout(seq, cp, tp, sequence_parallel=sp, cu_seqlens=cu)
            dest_shards[d] = image_token_shards(mask, layout)
        src_totals = {s: sum(counts[s * per_s : (s + 1) * per_s]) for s in s_dps}
        holds, needs = route_needs(
            plan, members, pieces=pieces, src_totals=src_totals, dest_shards=dest_shards
        )
        routes = {m: plan_route(members, m, holds, needs) for m in members}
        idx = {m: i for i, m in enumerate(members)}
        start = {m: holds[idx[m]][0] for m in members}

        # Forward: every rank's rows, labelled by their group token g.
        got = {}
        for r in members:
            rt = routes[r]
            y = [-1] * rt.n_local
            for pos, row in zip(rt.keep_y.tolist(), rt.keep_x.tolist()):
                y[pos] = start[r] + row
            for m in members:
                sent = routes[m].send_x[idx[r]].tolist()
                recv = rt.recv_y[idx[m]].tolist()
                assert len(sent) == len(recv), (m, r)
                for pos, row in zip(recv, sent):
                    assert y[pos] == -1
                    y[pos] = start[m] + row
            got[r] = y
            # Bytes at the bound: received rows are exactly those needed and not held.
            a, b = holds[idx[r]]
            assert sum(rt.fwd_rows()[1]) == sum(not a <= g < b for g in y)
            if plan.direction is not BridgeDirection.FAN_IN:
                assert sum(rt.fwd_rows()[1]) == 0  # FAN_OUT / EQUAL ranks hold their rows

        # Brute force: the image tokens of each rank's local shard, in shard order.
        for r in members:
            d = d_lay.coords(r)
            ss = range(d["dp"] * per_d, (d["dp"] + 1) * per_d)
            tokens = ref_local_tokens(
                [lengths[s] for s in ss], packed, cp, d["cp"], pieces, d["tp"] % pieces
            )
            want = [
                g_start[ss[i]] + positions[ss[i]].index(p)
                for i, p in (t for t in tokens if t)
                if p in positions[ss[i]]
            ]
            assert got[r] == want, (r, got[r], want)

        # Backward: each encoder row's gradient exactly once, from a rank that used it.
        for e in members:
            a, b = holds[idx[e]]
            seen = [[] for _ in range(b - a)]
            rt = routes[e]
            for pos, row in zip(rt.bwd_keep_y.tolist(), rt.bwd_keep_x.tolist()):
                seen[row].append(got[e][pos])
            for q in members:
                sent = routes[q].bwd_send_y[idx[e]].tolist()
                recv = rt.bwd_recv_x[idx[q]].tolist()
                assert len(sent) == len(recv), (q, e)
                for pos, row in zip(sent, recv):
                    seen[row].append(got[q][pos])
            assert seen == [[a + i] for i in range(b - a)], (e, seen)
