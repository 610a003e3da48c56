"""``route(..., balance=plan)`` on 8 gloo ranks against ``route_oracle``.

The route oracle's global batch (per sample a random set of image positions, some samples
none; ``X`` the image rows sample-major, ``W`` the loss weights), each sample's tokens cut
into images of at most 3 tokens; replica 0's first sample made heavy so the plan moves
images. Each encoder rank balances its rows (``ImageBalancer``; the stand-in encoder is the
identity, so the rows it holds after balancing are ``X``'s rows of its images) and routes
them with the plan; the LLM rank takes ``sum(W[g]·y[g])`` over its rows.

Checked: the routed rows equal the oracle's local image rows (``torch.equal``: only
copies) and ``partition.shard(full).embeddings[mask]``; ``x.grad == W`` on every encoder
rank (each TP replica: every holder gets every gradient); collectives and bytes exact:
balance forward one count all-gather + one all-to-all of the images that cross replicas;
route forward the world count row, the world all-gather of shard ids, one all-to-all of
exactly the rows each shard lacks; backward the route's all-to-all of exactly the
gradient rows each holder did not consume, then the balance's of the moved images.
A plan that moves nothing takes the plain route. Bad ``balance`` arguments raise locally.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import (
    ColocatedBridgeCommunicator,
    ImageBalancer,
    PartitionAdapter,
    plan_balance,
)
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, DistributedWorld
from tests.functional.route_oracle import ORDER, H, RouteBatch, local_image_rows

world = DistributedWorld(8)

LAYOUTS = [
    ("fan_in_cp2", dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)),
    ("fan_in_tp1_cp2", dict(tp=1, dp=8), dict(cp=2, dp=4)),
    ("fan_out_cp2", dict(tp=4, dp=2), dict(tp=2, cp=2, dp=2)),
    ("equal_cp1", dict(tp=2, dp=4), dict(tp=2, dp=4)),
]
CASES = [
    (f"{name}-{'sp' if sp else 'nosp'}-{'packed' if packed else 'plain'}", (src, dest, sp, packed))
    for name, src, dest in LAYOUTS
    for sp, packed in ((False, False), (True, True), (True, False))
]


def _images(batch: RouteBatch, samples: range) -> list[int]:
    """Tokens per image of ``samples`` (each sample's tokens cut into images of <= 3)."""
    out = []
    for s in samples:
        n = batch.counts[s]
        out += [3] * (n // 3) + ([n % 3] if n % 3 else [])
    return out


def _skewed_batch(n_samples: int, packed: bool) -> RouteBatch:
    batch = RouteBatch(n_samples, packed=packed)
    if not packed:  # replica 0's first sample: every position an image
        batch.positions[0] = list(range(batch.lengths[0]))
        batch.counts = [len(p) for p in batch.positions]
        batch.starts = [0]
        for c in batch.counts:
            batch.starts.append(batch.starts[-1] + c)
        gen = torch.Generator().manual_seed(9)
        batch.X = torch.randn(batch.starts[-1], H, generator=gen).to(batch.X.device)
        batch.W = torch.randn(batch.starts[-1], H, generator=gen).to(batch.X.device)
    return batch


@world.parametrize("src, dest, sp, packed", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_balanced_route_equals_one_process(src, dest, sp, packed):
    rank = dist.get_rank()
    batch = _skewed_batch(8, packed)
    src_grid = make_grid(**(dict(tp=1, dp=1) | src), axis_names=ORDER, create=("dp",))
    dest_grid = make_grid(**dest, axis_names=ORDER, create=("cp", "tp"))
    s_lay, d_lay = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    replica = s_lay.coords(rank)["dp"]
    s_samples, d_samples = batch.samples(s_lay, rank), batch.samples(d_lay, rank)
    own = batch.token_rows(s_samples)
    x = batch.X[own].clone().requires_grad_()
    tps = [batch.counts[s] for s in s_samples]
    mask, cu = batch.image_mask(d_samples)
    rows = local_image_rows(batch, d_lay, rank, packed=packed, sp=sp)
    partition = PartitionAdapter(
        cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"), sequence_parallel=sp
    )
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        bridge.prepare_route()
        balancer = ImageBalancer(dp_group=src_grid.get_pg("dp"), count_group=bridge.world_group)
        with CollectiveCounter() as fwd_balance:
            y_enc, plan = balancer.balance(x, _images(batch, s_samples))
        with CollectiveCounter() as fwd:
            y = bridge.route(y_enc, tokens_per_sample=tps, image_mask=mask, partition=partition,
                             cu_seqlens=cu, balance=plan)  # fmt: skip
        assert torch.equal(y, batch.X[rows]), "balanced route rows != the oracle's local rows"
        with CollectiveCounter() as bwd:
            (y * batch.W[rows]).sum().backward()
    assert torch.equal(x.grad, batch.W[own]), "x.grad != W"
    assert plan.moved_images > 0, plan  # the case exercises the balanced path

    # exact bytes. Held after balancing: the g of the images this replica encodes.
    starts, g = [], 0
    for ts in plan.tokens:
        starts.append([])
        for t in ts:
            starts[-1].append(g)
            g += t
    held = {
        starts[m.src][m.src_index] + i for m in plan.moves() if m.dest == replica
        for i in range(m.tokens)
    }  # fmt: skip
    row_bytes = H * x.element_size()
    n = dist.get_world_size()
    came_in = sum(k for d, k in enumerate(plan.recv_rows(replica)) if d != replica)
    sent_away = sum(k for e, k in enumerate(plan.send_rows(replica)) if e != replica)
    assert fwd_balance.bytes_received("all_to_all") == came_in * row_bytes
    widest = max(
        len([p for s in batch.samples(d_lay, r) for p in batch.positions[s]]) for r in range(n)
    )
    meta = (n - 1) * 8 * 7 + (n - 1) * 8 * widest  # count rows, shard ids
    assert fwd.counts() == {"all_gather": 2, "all_to_all": 1}, fwd.calls
    assert fwd.bytes_received("all_gather") == meta
    assert fwd.bytes_received("all_to_all") == sum(r not in held for r in rows) * row_bytes
    not_mine = sum(r not in set(rows) for r in held) * row_bytes
    assert bwd.counts() == {"all_to_all": 2}, bwd.calls
    assert bwd.bytes_received("all_to_all") == not_mine + sent_away * row_bytes


@world.case
def test_balance_that_moves_nothing_is_the_plain_route_and_bad_plans_raise():
    batch = RouteBatch(8, packed=False)
    src_grid = make_grid(tp=2, dp=4, axis_names=ORDER, create=("dp",))
    dest_grid = make_grid(tp=2, cp=2, dp=2, axis_names=ORDER, create=("cp", "tp"))
    s_lay, rank = GridLayout.from_grid(src_grid), dist.get_rank()
    s_samples = batch.samples(s_lay, rank)
    x = batch.X[batch.token_rows(s_samples)]
    tps = [batch.counts[s] for s in s_samples]
    mask, _ = batch.image_mask(batch.samples(GridLayout.from_grid(dest_grid), rank))
    partition = PartitionAdapter(cp_group=dest_grid.get_pg("cp"))
    # one image per replica: moving the heaviest replica's only image never helps
    totals = [sum(batch.counts[s] for s in batch.samples(s_lay, 2 * d)) for d in range(4)]
    still = plan_balance([[t] if t else [] for t in totals])
    assert still.moved_images == 0 and sum(totals) > 0
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        plain = bridge.route(x, tokens_per_sample=tps, image_mask=mask, partition=partition)
        with CollectiveCounter() as calls:
            y = bridge.route(x, tokens_per_sample=tps, image_mask=mask, partition=partition,
                             balance=still)  # fmt: skip
        assert torch.equal(y, plain)
        assert calls.counts() == {"all_gather": 1, "all_to_all": 1}, calls.calls  # plain route
        with CollectiveCounter() as calls:
            with pytest.raises(TypeError, match="balance must be the BalancePlan"):
                bridge.route(x, tokens_per_sample=tps, image_mask=mask, partition=partition,
                             balance=[[1]])  # fmt: skip
            with pytest.raises(ValueError, match="plans 2 encoder DP replicas but the encoder"):
                bridge.route(x, tokens_per_sample=tps, image_mask=mask, partition=partition,
                             balance=plan_balance([[1], [1]]))  # fmt: skip
            with pytest.raises(ValueError, match="pass the encoded rows of the balanced"):
                bridge.route(x[1:], tokens_per_sample=tps, image_mask=mask, partition=partition,
                             balance=still)  # fmt: skip
            with pytest.raises(ValueError, match="pass its pre-balance tokens_per_sample"):
                bridge.route(x, tokens_per_sample=[*tps, 1], image_mask=mask,
                             partition=partition, balance=still)  # fmt: skip
        assert calls.counts() == {}, calls.calls  # local errors: before any collective
