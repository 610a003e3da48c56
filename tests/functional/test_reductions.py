"""masked_sum/count/mean over DP×CP groups, and deterministic_all_reduce, on 8 ranks (and
deterministic_all_reduce on a group of three of a 6-rank world).

Layout for the masked reductions: ``make_grid(tp=2, cp=2, dp=2)``; the global batch
``[4, 16]`` is split over DP by rows and over CP by columns, TP ranks hold copies. Each
rank builds the full tensors from one seed and compares with the single-process masked
mean. Tolerance: fp32 sums of 64 values in another order, 1e-6 relative; the gradient
``mask / count`` is one division, compared at 1e-7 relative.

deterministic_all_reduce: the reference folds the per-rank tensors in rank order in one
process, so the comparison is bitwise (``torch.equal``), as are the cross-rank checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.checks import AgreementError
from mp_bridge.comm import deterministic_all_reduce
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.layers import masked_count, masked_mean, masked_sum
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import rand, tp_cp_groups

world = DistributedWorld(8)
_GRID = {}


def grid():
    if not _GRID:
        g = make_grid(tp=2, cp=2, dp=2, create=("dp", "cp", ("dp", "cp")))
        _GRID["grid"] = g
        _GRID["layout"] = GridLayout.from_grid(g)
    return _GRID["grid"], _GRID["layout"]


def _full(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 16, generator=gen)
    mask = torch.rand(4, 16, generator=gen) < 0.6
    values[~mask] = float("nan")  # masked positions must never leak in
    return values.to(current_device()), mask.to(current_device())


def _local(full: torch.Tensor) -> torch.Tensor:
    _, layout = grid()
    c = layout.coords(dist.get_rank())
    return full[2 * c["dp"] : 2 * c["dp"] + 2, 8 * c["cp"] : 8 * c["cp"] + 8]


@world.case
def test_masked_mean_over_dp_cp_equals_single_process():
    g, _ = grid()
    values, mask = _full()
    ref = values[mask].double().mean()
    count = int(mask.sum())
    for group in (g.get_pg(["dp", "cp"]), [g.get_pg("dp"), g.get_pg("cp")]):
        local = _local(values).clone().requires_grad_()
        with CollectiveCounter() as counter:
            mean = masked_mean(local, _local(mask), group=group)
        n_groups = 1 if isinstance(group, dist.ProcessGroup) else 2
        assert counter.counts() == {"all_reduce": n_groups}
        torch.testing.assert_close(mean.double(), ref, atol=0, rtol=1e-6)
        (grad,) = torch.autograd.grad(mean, local)
        want = _local(mask).float() / count
        torch.testing.assert_close(grad, want, atol=0, rtol=1e-7)
        total = masked_sum(_local(values), _local(mask), group=group)
        torch.testing.assert_close(
            total.double(), values[mask].double().sum(), atol=1e-5, rtol=1e-6
        )
        assert masked_count(_local(mask), group=group).item() == count


@world.case
def test_a_group_listed_twice_is_refused_before_any_collective():
    g, _ = grid()
    values, mask = _full()
    dp = g.get_pg("dp")
    for fn, args in ((masked_sum, (values, mask)), (masked_count, (mask,))):
        with CollectiveCounter() as counter:
            with pytest.raises(ValueError, match=r"group lists the same process group twice"):
                fn(*args, group=[dp, g.get_pg("cp"), dp])
        assert counter.calls == [] and counter.check_calls == []
    with pytest.raises(ValueError, match=r"would count every value twice: pass each group once"):
        masked_mean(values, mask, group=(dp, dp))


@world.case
def test_masked_mean_weights_empty_and_single_process():
    g, _ = grid()
    values, mask = _full(1)
    weights = torch.rand(4, 16, generator=torch.Generator().manual_seed(2)).to(values.device)
    weights[~mask] = 0
    got = masked_mean(_local(values), _local(weights), group=g.get_pg(["dp", "cp"]))
    ref = (values[mask].double() * weights[mask].double()).sum() / weights.double().sum()
    torch.testing.assert_close(got.double(), ref, atol=0, rtol=1e-6)
    # No selected token anywhere: 0, and a zero (not nan) gradient.
    local = _local(values).clone().requires_grad_()
    empty = torch.zeros_like(_local(mask))
    mean = masked_mean(local, empty, group=g.get_pg(["dp", "cp"]))
    (grad,) = torch.autograd.grad(mean, local)
    assert mean.item() == 0 and torch.all(grad == 0)
    # group=None: a plain single-process masked mean, no collective.
    with CollectiveCounter() as counter:
        one = masked_mean(values, mask)
    assert counter.counts() == {}
    torch.testing.assert_close(one.double(), values[mask].double().mean(), atol=0, rtol=1e-6)


def _per_rank(rank: int, shape=(5, 3), dtype=torch.float32) -> torch.Tensor:
    # Magnitudes spread over 1e-3..1e3 so the summation order changes the last bits.
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(shape, generator=gen) * 10 ** torch.randint(-3, 4, shape, generator=gen)
    return x.to(dtype).to(current_device())


def _fold(parts, op: str, acc=torch.float32):
    out = parts[0].to(acc)
    for p in parts[1:]:
        p = p.to(acc)
        out = out + p if op in ("sum", "mean") else getattr(torch, op + "imum")(out, p)
    return out / len(parts) if op == "mean" else out


def _same_on_all_ranks(x: torch.Tensor) -> bool:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return all(torch.equal(p, parts[0]) for p in parts)


@world.case
def test_deterministic_all_reduce_bitwise_in_rank_order():
    n = dist.get_world_size()
    mine = _per_rank(dist.get_rank())
    before = mine.clone()
    for op in ("sum", "mean", "max", "min"):
        out = deterministic_all_reduce(mine, op=op, group=dist.group.WORLD)
        want = _fold([_per_rank(r) for r in range(n)], op)
        assert torch.equal(out, want), op
        assert _same_on_all_ranks(out), op
        assert torch.equal(deterministic_all_reduce(mine, dist.group.WORLD, op=op), out)
    assert torch.equal(mine, before)  # out of place


@world.case
def test_deterministic_all_reduce_bf16_and_non_contiguous():
    n = dist.get_world_size()
    world_group = dist.group.WORLD
    big = _per_rank(dist.get_rank(), shape=(6, 4))
    view = big.t()[1:, ::2]  # non-contiguous view
    assert not view.is_contiguous()
    out = deterministic_all_reduce(view, world_group)
    assert out.shape == view.shape
    assert torch.equal(out, deterministic_all_reduce(view.contiguous(), world_group))
    want = _fold([_per_rank(r, shape=(6, 4)).t()[1:, ::2] for r in range(n)], "sum")
    assert torch.equal(out, want)
    b = _per_rank(dist.get_rank(), dtype=torch.bfloat16)
    out_b = deterministic_all_reduce(b, world_group)  # fp32 accumulation, bf16 result
    assert out_b.dtype == torch.bfloat16
    want_b = _fold([_per_rank(r, dtype=torch.bfloat16) for r in range(n)], "sum").bfloat16()
    assert torch.equal(out_b, want_b) and _same_on_all_ranks(out_b)
    ints = torch.arange(6, device=current_device()) * (dist.get_rank() + 1)
    want_i = torch.arange(6, device=current_device()) * 36  # 1 + 2 + ... + 8 = 36
    assert torch.equal(deterministic_all_reduce(ints, world_group), want_i)
    assert torch.equal(deterministic_all_reduce(b), b) and deterministic_all_reduce(b) is not b


@world.case
def test_deterministic_all_reduce_errors_before_the_collective():
    x = torch.ones(3, device=current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"op='avg' is not supported; use one of"):
            deterministic_all_reduce(x, dist.group.WORLD, op="avg")
        with pytest.raises(TypeError, match="op='mean' needs a floating tensor"):
            deterministic_all_reduce(x.long(), dist.group.WORLD, op="mean")
    assert counter.counts() == {}
    odd = torch.ones(4 if dist.get_rank() == 3 else 3, device=current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(AgreementError, match=r"shape: ranks \[0, 1, 2, 4, 5, 6, 7\] have"):
            deterministic_all_reduce(odd, dist.group.WORLD)
    assert counter.counts() == {}  # the agreement check's row gather only, nothing else
    assert [c.name for c in counter.check_calls] == ["all_gather", "all_gather_object"]
    # Another op on one rank: the same error on every rank, not silently another fold.
    op = "max" if dist.get_rank() == 5 else "sum"
    with pytest.raises(AgreementError) as info:
        deterministic_all_reduce(x, dist.group.WORLD, op=op)
    assert "deterministic_all_reduce: ranks disagree on op" in str(info.value)
    assert "ranks [5] have max" in str(info.value)
    # Another dtype, with check=False too: the check is on by default, whatever the env.
    y = x.double() if dist.get_rank() == 2 else x
    with pytest.raises(AgreementError, match=r"ranks disagree on dtype, accumulate_dtype"):
        deterministic_all_reduce(y, dist.group.WORLD)


@world.case(world_size=6)
def test_deterministic_all_reduce_on_a_group_of_three():
    cp_g = tp_cp_groups(3)[0]  # ranks {0, 2, 4} or {1, 3, 5}
    members = dist.get_process_group_ranks(cp_g)
    mine = rand(5, 4, seed=30 + dist.get_rank()).t()[:, 1:]  # non-contiguous [4, 4] view
    parts = [rand(5, 4, seed=30 + m).t()[:, 1:] for m in members]
    want = (parts[0] + parts[1]) + parts[2]  # fp32 fold in group rank order
    assert torch.equal(deterministic_all_reduce(mine, cp_g), want)
    assert torch.equal(deterministic_all_reduce(mine, cp_g, op=dist.ReduceOp.SUM), want)
    assert torch.equal(deterministic_all_reduce(mine, cp_g, op="mean"), want / 3)
    empty = torch.zeros(0, 3, device=current_device())
    assert deterministic_all_reduce(empty, cp_g).shape == (0, 3)
