"""``ImageBalancer`` on 8 gloo ranks (encoder tp2·dp4 and tp1·dp8) against one process.

Every rank builds the same global batch from one seed: 2 samples per encoder DP replica,
a skewed number of images per sample (replica 0 heavy, replica 1 text-only, others 0-2)
and ragged tokens per image; image rows ``X`` ``[T, P]`` sample-major, output weights
``R`` ``[T, H]``. The stand-in encoder maps each image ``X_i`` ``[t, P]`` to
``X_i W + (1ᵀ X_i a)² b`` (a per-row linear plus a per-image quadratic term, so an image
split across replicas, or rows of two images swapped, changes the result). Each replica
balances its rows, encodes what it received, restores the rows to its own order and
takes ``sum(R · out)``; the oracle runs the same encoder per image on the full ``X``.

Checked on every rank: the restored rows and ``x.grad`` equal the single-process rows and
gradient; the DP-summed ``W``/``a``/``b`` gradients equal the full ones; every rank holds
the same plan; collectives and bytes are exact (count row all-gather; image rows in,
gradients back, features back, their gradients in; nothing when no image moves).
Tolerance: float64; rows and ``x.grad`` ``atol=1e-12`` (the same per-image ops on the same
rows: exact but for a BLAS blocking by alignment), parameter gradients ``rtol=1e-10`` (the
DP sum adds the images in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.checks import AgreementError
from mp_bridge.comm.bridge.execution.balancer import HEADER, ImageBalancer
from mp_bridge.comm.bridge.plans.balance_plan import plan_balance
from mp_bridge.grid import make_grid
from mp_bridge.grid.destroy import destroy_grid
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device

world = DistributedWorld(8)
P, H = 5, 3
ORDER = ("tp", "cp", "pp", "dp")
EXACT = dict(rtol=0.0, atol=1e-12)


def _tokens(dp: int, skewed: bool, seed: int = 3) -> list[list[int]]:
    """Tokens per image of each replica (its 2 samples' images, sample-major)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d in range(dp):
        if not skewed:
            out.append([3, 1, 2])  # the same images everywhere: nothing to balance
            continue
        n_images = 7 if d == 0 else 0 if d == 1 else int(torch.randint(0, 5, (1,), generator=gen))
        high = 12 if d == 0 else 6
        out.append(torch.randint(1, high, (n_images,), generator=gen).tolist())
    return out


def _encode(rows, counts, w, a, b):
    """The stand-in encoder, image by image: ``X_i W + (1ᵀ X_i a)² b``."""
    out = [x @ w + (x.sum(0) @ a) ** 2 * b for x in torch.split(rows, list(counts))]
    return torch.cat(out) if out else rows.new_zeros((0, w.shape[1]))


def _params(seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    w, a, b = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((P, H), (P,), (H,)))
    return [t.to(current_device()).requires_grad_() for t in (w, a, b)]


def _grid(tp: int, dp: int):
    return make_grid(tp=tp, dp=dp, axis_names=ORDER, create=("tp", "dp"))


def _row_bytes(width: int) -> int:
    return 8 * width


@world.parametrize(
    "tp, dp, skewed, cap",
    [(2, 4, True, 64), (1, 8, True, 64), (2, 4, True, 3), (1, 8, True, 2), (2, 4, False, 64)],
    ids=["tp2dp4", "tp1dp8", "tp2dp4-cap3", "tp1dp8-cap2", "tp2dp4-balanced"],
)
def test_balanced_encoder_equals_one_process(tp, dp, skewed, cap):
    grid = _grid(tp, dp)
    replica = dist.get_rank() // tp
    tokens = _tokens(dp, skewed)
    total = sum(map(sum, tokens))
    gen = torch.Generator().manual_seed(5)
    dev = current_device()
    x_full = torch.randn(total, P, generator=gen, dtype=torch.float64).to(dev).requires_grad_()
    r_full = torch.randn(total, H, generator=gen, dtype=torch.float64).to(dev)
    params = _params()
    flat = [t for r in tokens for t in r]
    (r_full * _encode(x_full, flat, *params)).sum().backward()
    y_full = _encode(x_full.detach(), flat, *(p.detach() for p in params))
    start = sum(map(sum, tokens[:replica]))
    rows = slice(start, start + sum(tokens[replica]))

    local = _params()
    x = x_full.detach()[rows].clone().requires_grad_()
    balancer = ImageBalancer(dp_group=grid.get_pg("dp"), count_group=dist.group.WORLD, c=2.0,
                             cap=cap)  # fmt: skip
    with CollectiveCounter() as fwd:
        y, plan = balancer.balance(x, tokens[replica])
    z = _encode(y, plan.tokens_after(replica), *local)
    with CollectiveCounter() as back:
        out = balancer.restore(z, plan)
    loss = (r_full[rows] * out).sum()
    with CollectiveCounter() as bwd:
        loss.backward()

    assert plan == plan_balance(tokens, c=2.0)
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, (plan.dest, plan.dest_index))
    assert all(p == plans[0] for p in plans)
    torch.testing.assert_close(out.detach(), y_full[rows], **EXACT)
    torch.testing.assert_close(x.grad, x_full.grad[rows], **EXACT)
    for p, ref in zip(local, params):
        g = p.grad.clone()
        dist.all_reduce(g, group=grid.get_pg("dp"))
        torch.testing.assert_close(g, ref.grad, rtol=1e-10, atol=1e-12)

    # bytes: the count row from every other rank (twice the width past the cap), then
    # exactly the rows of the images that cross replicas, once per direction
    sent_away = sum(n for e, n in enumerate(plan.send_rows(replica)) if e != replica)
    came_in = sum(n for d, n in enumerate(plan.recv_rows(replica)) if d != replica)
    widest = max(map(len, tokens))
    gathers = 2 if widest > cap else 1
    moved = 1 if plan.moved_images else 0
    assert fwd.counts() == {"all_gather": gathers} | ({"all_to_all": 1} if moved else {})
    row = _row_bytes(len(HEADER) + cap) + (_row_bytes(widest) if gathers == 2 else 0)
    assert fwd.bytes_received("all_gather") == 7 * row
    assert fwd.bytes_received("all_to_all") == came_in * P * 8
    assert back.bytes_received("all_to_all") == sent_away * H * 8
    assert bwd.counts() == ({"all_to_all": 2} if moved else {})
    assert bwd.bytes_received() == (came_in * H + sent_away * P) * 8
    if skewed:
        assert moved and plan.ratio_after() < plan.ratio_before()
    else:
        assert not moved and y is x and out is z
    destroy_grid(grid)


def _expect_same_error(error, match, fn):
    with pytest.raises(error, match=match) as info:
        fn()
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, messages
    dist.barrier()


@world.case
def test_tp_peers_with_other_counts_raise_the_same_error_on_every_rank():
    grid = _grid(2, 4)
    rank = dist.get_rank()
    tokens = [3, 1, 2] if rank != 5 else [3, 2, 1]  # rank 5: TP rank 1 of replica 2
    x = torch.randn(6, P).to(current_device())
    balancer = ImageBalancer(dp_group=grid.get_pg("dp"), count_group=dist.group.WORLD)
    match = (
        r"the TP ranks of encoder DP replica 2 disagree on tokens_per_image \(or costs\): "
        r"rank 4 passes 3 images of 6 tokens \[3, 1, 2\], rank 5 passes 3 images of 6 "
        r"tokens \[3, 2, 1\]"
    )
    _expect_same_error(ValueError, match, lambda: balancer.balance(x, tokens))
    destroy_grid(grid)


@world.case
def test_ranks_with_another_cost_parameter_raise_the_same_error_on_every_rank():
    grid = _grid(1, 8)
    c = 3.0 if dist.get_rank() == 6 else 1.0
    balancer = ImageBalancer(dp_group=grid.get_pg("dp"), count_group=dist.group.WORLD, c=c)
    match = r"(?s)ranks disagree on c .*ranks \[0, 1, 2, 3, 4, 5, 7\] have 1.0; ranks \[6\] have 3"
    x = torch.randn(4, P).to(current_device())
    _expect_same_error(AgreementError, match, lambda: balancer.balance(x, [4]))
    destroy_grid(grid)


@world.case
def test_local_validation_raises_before_any_collective():
    grid = _grid(2, 4)
    balancer = ImageBalancer(dp_group=grid.get_pg("dp"), count_group=dist.group.WORLD)
    x = torch.randn(5, P).to(current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"tokens_per_image sums to 4 but x has 5 rows"):
            balancer.balance(x, [3, 1])
        with pytest.raises(ValueError, match=r"tokens_per_image=\[5, 0\] must hold ints >= 1"):
            balancer.balance(x, [5, 0])
        with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
            balancer.balance([[0.0] * P] * 5, [5])
        with pytest.raises(ValueError, match=r"costs has shape \(2,\).*shape \(1,\)"):
            balancer.balance(x, [5], costs=torch.ones(2, device=x.device))
    assert counter.calls == []
    with pytest.raises(TypeError, match=r"dp_group=4 must be a torch.distributed ProcessGroup"):
        ImageBalancer(dp_group=4)
    destroy_grid(grid)
