"""Double backward (``create_graph=True``) through the comm collectives, on 2 ranks.

Each case differentiates a per-rank loss twice through a collective and compares the
first gradient and a Hessian-vector product with plain autograd on the full tensors in
one process. The losses are cubic, so the second derivative is not zero and a backward
collective missing from the graph shows (before the adjoints were Functions, the
gradient had no graph at all). Tolerance: float64 and the same formulas; only the order
of two-term sums may differ, so 1e-12 relative/absolute is ample (values are O(10)).

The bridge's FAN_IN/FAN_OUT cannot differentiate twice and must say so.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import (
    ColocatedBridgeCommunicator,
    copy_to_group,
    gather_along,
    gather_keep_grad,
    gather_kv,
    reduce_scatter_along,
    scatter_along,
)
from mp_bridge.grid import GridLayout, destroy_grid, make_grid
from mp_bridge.testing import DistributedWorld, current_device

N = 2
world = DistributedWorld(N)
TOL = dict(rtol=1e-12, atol=1e-12)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU, then on the rank's device
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(current_device())


def _weights(shape) -> list[torch.Tensor]:
    return [_rand(*shape, seed=100 + r) for r in range(N)]  # rank r's loss weights


def _twice(loss_of, x: torch.Tensor, v: torch.Tensor):
    """(gradient, Hessian-vector product with ``v``) of ``loss_of(x)`` by autograd."""
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss_of(x), x, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), x)
    return g.detach(), hv


def _chunk(t: torch.Tensor, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(N, dim)[r]


@world.case
def test_gather_along_and_reduce_scatter_adjoint_pair():
    r = dist.get_rank()
    full, v = _rand(4, 3, seed=1), _rand(4, 3, seed=2)
    w = _weights((4, 3))
    g, hv = _twice(lambda x: (w[r] * gather_along(x, dist.group.WORLD, 0) ** 3).sum(),
                   _chunk(full, r), _chunk(v, r))  # fmt: skip
    ref_g, ref_hv = _twice(lambda x: sum((wr * x**3).sum() for wr in w), full, v)
    torch.testing.assert_close(g, _chunk(ref_g, r), **TOL)
    torch.testing.assert_close(hv, _chunk(ref_hv, r), **TOL)


@world.case
def test_reduce_scatter_along_and_gather_adjoint_pair():
    r = dist.get_rank()
    parts, vs = _rand(N, 4, 3, seed=3), _rand(N, 4, 3, seed=4)  # rank r holds parts[r]
    w = _weights((2, 3))

    def ref(xs):
        total = xs.sum(0)
        return sum((w[k] * _chunk(total, k) ** 3).sum() for k in range(N))

    g, hv = _twice(lambda x: (w[r] * reduce_scatter_along(x, dist.group.WORLD, 0) ** 3).sum(),
                   parts[r], vs[r])  # fmt: skip
    ref_g, ref_hv = _twice(ref, parts, vs)
    torch.testing.assert_close(g, ref_g[r], **TOL)
    torch.testing.assert_close(hv, ref_hv[r], **TOL)


@world.case
def test_copy_and_reduce_adjoint_pair():
    # Replicated input: the gradient is the sum over ranks' losses (Megatron's f / g).
    r = dist.get_rank()
    x, v = _rand(5, seed=5), _rand(5, seed=6)
    w = _weights((5,))
    g, hv = _twice(lambda t: (w[r] * copy_to_group(t, dist.group.WORLD) ** 3).sum(), x, v)
    ref_g, ref_hv = _twice(lambda t: sum((wr * t**3).sum() for wr in w), x, v)
    torch.testing.assert_close(g, ref_g, **TOL)
    torch.testing.assert_close(hv, ref_hv, **TOL)


@world.case
def test_scatter_and_gather_keep_grad_adjoint_pair():
    r = dist.get_rank()
    x, v = _rand(4, 3, seed=7), _rand(4, 3, seed=8)  # replicated
    w = _weights((2, 3))
    g, hv = _twice(lambda t: (w[r] * scatter_along(t, dist.group.WORLD, 0) ** 3).sum(), x, v)
    ref_g, ref_hv = _twice(lambda t: sum((w[k] * _chunk(t, k) ** 3).sum() for k in range(N)), x, v)
    torch.testing.assert_close(g, ref_g, **TOL)
    torch.testing.assert_close(hv, ref_hv, **TOL)


@world.case
def test_gather_keep_grad_and_scatter_adjoint_pair():
    # The same loss on every rank, so the gathered tensor's gradient is replicated.
    r = dist.get_rank()
    full, v = _rand(4, 3, seed=9), _rand(4, 3, seed=10)
    w = _rand(4, 3, seed=11)
    g, hv = _twice(lambda x: (w * gather_keep_grad(x, dist.group.WORLD, 0) ** 3).sum(),
                   _chunk(full, r), _chunk(v, r))  # fmt: skip
    ref_g, ref_hv = _twice(lambda x: (w * x**3).sum(), full, v)
    torch.testing.assert_close(g, _chunk(ref_g, r), **TOL)
    torch.testing.assert_close(hv, _chunk(ref_hv, r), **TOL)


@world.case
def test_gather_kv_and_reduce_scatter_kv_adjoint_pair():
    r = dist.get_rank()
    full, v = _rand(2, 1, 6, 2, 3, seed=12), _rand(2, 1, 6, 2, 3, seed=13)  # [2, b, S, hk, d]
    pos_full = torch.tensor([[5, 1, 4, 0, 3, 2]], device=current_device())
    w = _weights((2, 1, 6, 2, 3))
    kv_all, pos_all = gather_kv(_chunk(full, r, 2), _chunk(pos_full, r, 1), dist.group.WORLD)
    assert torch.equal(pos_all, pos_full) and torch.equal(kv_all, full)
    g, hv = _twice(lambda x: (w[r] * gather_kv(x, None, dist.group.WORLD)[0] ** 3).sum(),
                   _chunk(full, r, 2), _chunk(v, r, 2))  # fmt: skip
    ref_g, ref_hv = _twice(lambda x: sum((wr * x**3).sum() for wr in w), full, v)
    torch.testing.assert_close(g, _chunk(ref_g, r, 2), **TOL)
    torch.testing.assert_close(hv, _chunk(ref_hv, r, 2), **TOL)


@world.case
def test_bridge_refuses_create_graph_and_make_grid_axis_names_alias():
    src = make_grid(tp=1, dp=2, axis_names=("tp", "dp"), create=())
    dest = make_grid(tp=2, dp=1, axis_names=("tp", "dp"), create=())
    assert GridLayout.from_grid(src) == GridLayout((1, 2), ("tp", "dp"))
    for a, b in ((src, dest), (dest, src)):  # FAN_IN, then FAN_OUT
        bridge = ColocatedBridgeCommunicator(a, b, dim_mapping={"b": 0, "h": 1})
        x = _rand(2 if a is src else 4, 3, seed=14).requires_grad_()
        y = bridge.communicate(x)
        with pytest.raises(RuntimeError, match="cannot differentiate twice"):
            torch.autograd.grad((y**3).sum(), x, create_graph=True)
        (g,) = torch.autograd.grad((y**3).sum(), x)  # a single backward still works
        assert g.shape == x.shape
        bridge.destroy()
    destroy_grid(src)
    destroy_grid(dest)
