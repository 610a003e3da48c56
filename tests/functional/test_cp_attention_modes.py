"""context_parallel_attention's three ``comm`` modes against the float64 dense oracle, on
4 ranks: CP 1, 2, 3 (a 3-rank group) and 4; plain and packed input (odd document lengths,
one-token documents, padded by the adapter); causal and not; GQA; fp32 and bf16; arbitrary
positions (the masked fallback, fully masked block pairs); dq, dk and dv.

Oracle: ``tests.oracles.dense_attention_fp64`` on the full tensors (the whole score
matrix in float64), the same on every rank. Tokens are cut and padded by
``PartitionAdapter``; gradients of the full tensors, summed over CP, are the full ones.

Tolerances. fp32: the kernels sum the softmax in another order and the merge adds a few
LSE-weighted partials, so the result differs from float64 by fp32 rounding over a few
dozen terms (measured here: max abs error <= 2e-6 on values of order 1);
``atol = rtol = 1e-5`` leaves a 5x margin while a wrong mask or merge gives O(0.1).
bf16: inputs, kernel products and the output are rounded to bf16 (8 mantissa bits,
relative step 2^-8 = 3.9e-3), so ``atol = rtol = 3e-2`` (measured <= 1.6e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import PartitionAdapter
from mp_bridge.layers import context_parallel_attention
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import cu_of, dense_attention_fp64, packed_visibility, rand, tp_cp_groups

world = DistributedWorld(4)
MODES = ("all_gather", "ring", "a2a")
LENGTHS = (7, 1, 12, 1, 5)  # odd lengths and one-token documents
TOL32 = dict(rtol=1e-5, atol=1e-5)  # see module docstring
TOL16 = dict(rtol=3e-2, atol=3e-2)
_GROUPS: dict[int, object] = {}


def _cp_group(cp: int):
    """``(group, rank)`` of a CP group of ``cp`` ranks, or ``(None, None)`` off it."""
    if cp == 3:
        if 3 not in _GROUPS:
            _GROUPS[3] = dist.new_group([0, 1, 2])
        me = dist.get_rank()
        return (_GROUPS[3], me) if me < 3 else (None, None)
    group, _, rank, _ = tp_cp_groups(cp, tp=1)
    return group, rank


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    out = t.clone()
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


def _check_grads(full, ref_grads, group, tol, where):
    """dq, dk, dv: each rank's full-tensor gradient (zero off its tokens) summed over CP
    against the oracle's."""
    for name, t, g in zip("qkv", full, ref_grads):
        torch.testing.assert_close(
            _sum_over(t.grad, group).double(),
            g.double(),
            **tol,
            msg=lambda m, n=name: f"d{n} {where}: {m}",
        )


def _check(cp, mode, *, packed, causal, dtype=torch.float32, tol=TOL32):
    group, r = _cp_group(cp)
    if r is None:
        return
    hk = {1: 2, 2: 2, 3: 3, 4: 4}[cp]
    hq, d = 2 * hk, 8
    b, s = (1, sum(LENGTHS)) if packed else (2, 24)
    full = [rand(b, s, h, d, seed=i).to(dtype).requires_grad_() for i, h in enumerate((hq, hk, hk))]
    grad_out = rand(b, s, hq, d, seed=9).to(dtype)
    if packed:
        vis = packed_visibility(LENGTHS, causal, full[0].device)
    else:
        vis = packed_visibility((s,), causal, full[0].device)
    ref = dense_attention_fp64(*full, vis)
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), full)

    cu = cu_of(LENGTHS) if packed else None
    adapter = PartitionAdapter(cp_group=group)
    shards = [adapter.shard(t, cu_seqlens=cu) for t in full]
    q, k, v = (sh.embeddings for sh in shards)
    out = context_parallel_attention(
        q, k, v, cp_group=group, causal=causal, comm=mode, layout=shards[0].layout
    )
    assert out.dtype == dtype
    got = adapter.unshard(out, cu_seqlens=cu, seq_len=None if packed else s, grad="slice")
    where = f"cp={cp} {mode} packed={packed} causal={causal} {dtype}"
    torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m: f"{where}: {m}")
    out_grad = adapter.shard(grad_out, cu_seqlens=cu).embeddings
    (out * out_grad).sum().backward()
    _check_grads(full, ref_grads, group, tol, where)


@world.case
def test_every_mode_and_cp_size_matches_the_fp64_oracle_fp32():
    for cp in (1, 2, 3, 4):
        for mode in MODES:
            for packed in (False, True):
                for causal in (True, False):
                    _check(cp, mode, packed=packed, causal=causal)


@world.case
def test_every_mode_in_bf16_runs_the_kernel_in_bf16_and_returns_bf16():
    for mode in MODES:
        _check(2, mode, packed=True, causal=True, dtype=torch.bfloat16, tol=TOL16)
        _check(4, mode, packed=False, causal=True, dtype=torch.bfloat16, tol=TOL16)


def _arbitrary_positions(cp, mode, *, per_row):
    """Positions that form no runs: a random permutation, one per row when ``per_row``."""
    group, r = _cp_group(cp)
    if r is None:
        return
    b, s, hq, hk, d = 2, 24, 2 * cp, cp, 4
    full = [rand(b, s, h, d, seed=20 + i).requires_grad_() for i, h in enumerate((hq, hk, hk))]
    g = torch.Generator().manual_seed(7)
    rows = b if per_row else 1
    pos = torch.stack([torch.randperm(s, generator=g) for _ in range(rows)]).to(full[0].device)
    vis = pos[:, None, :] <= pos[:, :, None]  # [rows, s, s]
    ref = dense_attention_fp64(*full, vis)
    ref_grads = torch.autograd.grad(ref.square().sum(), full)
    mine = torch.arange(r * s // cp, (r + 1) * s // cp, device=pos.device)  # contiguous cut
    q, k, v = (t.index_select(1, mine) for t in full)
    out = context_parallel_attention(
        q, k, v, cp_group=group, position_ids=pos.index_select(1, mine), comm=mode, kv_block=4
    )
    where = f"cp={cp} {mode} per_row={per_row}"
    torch.testing.assert_close(
        out.double(), ref.index_select(1, mine), **TOL32, msg=lambda m: f"{where}: {m}"
    )
    out.square().sum().backward()
    _check_grads(full, ref_grads, group, TOL32, where)


@world.case
def test_arbitrary_positions_take_masked_blocks_in_every_mode():
    # kv_block=4 over 24 permuted positions: many block pairs see nothing at all.
    for cp in (1, 2, 4):
        for mode in MODES:
            _arbitrary_positions(cp, mode, per_row=False)
    _arbitrary_positions(2, "all_gather", per_row=True)
    _arbitrary_positions(2, "ring", per_row=True)


@world.case
def test_collectives_and_bytes_of_each_mode():
    cp = 4
    group, _ = _cp_group(cp)
    b, s, h, d = 1, 8, 4, 4  # 8 local tokens, layout from the adapter: no positions sent
    adapter = PartitionAdapter(cp_group=group)
    layout = adapter.shard(torch.zeros(b, s * cp, 1, device=current_device())).layout
    kv_bytes = 2 * b * s * h * d * 4
    expected = {
        "all_gather": ({"all_gather": 1}, {"reduce_scatter": 1}),
        "ring": ({"send": 3, "recv": 3}, {"send": 6, "recv": 6}),
        "a2a": ({"all_to_all": 3}, {"all_to_all": 3}),
    }
    for mode in MODES:
        q, k, v = (rand(b, s, h, d, seed=30 + i).requires_grad_() for i in range(3))
        with CollectiveCounter() as fwd:
            out = context_parallel_attention(q, k, v, cp_group=group, comm=mode, layout=layout)
        with CollectiveCounter() as bwd:
            out.sum().backward()
        assert (fwd.counts(), bwd.counts()) == expected[mode], mode
        if mode == "all_gather":
            assert fwd.bytes_received() == kv_bytes * (cp - 1)
        if mode == "ring":  # the all-gather's bytes forward; twice that backward
            assert fwd.bytes_received("recv") == kv_bytes * (cp - 1)
            assert bwd.bytes_received("recv") == 2 * kv_bytes * (cp - 1)


@world.case
def test_non_finite_keys_reach_only_the_queries_that_see_them():
    cp = 2
    group, r = _cp_group(cp)
    lengths = (8, 8)  # two documents of 8 tokens
    full = [rand(1, 16, 2, 4, seed=40 + i) for i in range(3)]
    full[1][0, 12] = float("nan")  # a key of document 1 (position 4 there)
    full[2][0, 3] = float("inf")  # a value of document 0 (position 3)
    adapter = PartitionAdapter(cp_group=group)
    shards = [adapter.shard(t, cu_seqlens=cu_of(lengths)) for t in full]
    for mode in MODES:
        out = context_parallel_attention(
            *(sh.embeddings for sh in shards), cp_group=group, comm=mode, layout=shards[0].layout
        )
        full_out = adapter.unshard(out, cu_seqlens=cu_of(lengths))[0]  # [16, h, d]
        finite = torch.isfinite(full_out).all(-1).all(-1)
        # document 0: positions 0..2 see no bad value; 3.. see the inf value (visible).
        # document 1: positions 0..3 (tokens 8..11) never see the nan key at position 4.
        assert finite[:3].all() and not finite[3:8].any(), (mode, finite)
        assert finite[8:12].all() and not finite[12:].any(), (mode, finite)


@world.case
def test_double_backward_and_bad_modes_raise_before_any_collective():
    group, _ = _cp_group(4)
    q = rand(1, 8, 4, 4, seed=50).requires_grad_()
    pos = torch.arange(8, device=q.device) * 4 + dist.get_rank()
    out = context_parallel_attention(q, q, q, cp_group=group, position_ids=pos)
    with pytest.raises(RuntimeError, match="cannot differentiate twice"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"q heads 6 and k/v heads 3 must each divide by 4"):
            context_parallel_attention(
                rand(1, 8, 6, 4, seed=1), *(rand(1, 8, 3, 4, seed=2),) * 2, cp_group=group,
                position_ids=pos, comm="a2a",
            )  # fmt: skip
        with pytest.raises(ValueError, match=r"comm='ring2' is not one of"):
            context_parallel_attention(q, q, q, cp_group=group, position_ids=pos, comm="ring2")
        with pytest.raises(ValueError, match=r"kv_block=0 must be an int >= 1"):
            context_parallel_attention(q, q, q, cp_group=group, position_ids=pos, kv_block=0)
    assert counter.counts() == {}


@world.case
def test_a_model_whose_heads_do_not_split_for_a2a_is_refused_at_build():
    """LLM TP 2 / CP 2 with 2 K/V heads: each TP rank holds 1, which ``comm="a2a"`` cannot
    split over CP 2. ``build_colocated_mimo`` names the counts before creating any group
    (no collective), instead of the first forward failing inside attention."""
    from mp_bridge.grid import destroy_grid, make_grid
    from mp_bridge.models import MimoConfig, build_colocated_mimo

    cfg = MimoConfig(llm_kv_heads=2)  # 8 q heads: 4 per TP rank, 1 K/V head per TP rank
    enc = make_grid(tp=2, dp=2, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=2, dp=1, create=("tp", "cp", "dp", ("dp", "cp")))
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"q heads 4 and k/v heads 1 must each divide by 2"):
            build_colocated_mimo(cfg, enc, llm, cp_comm="a2a")
    assert counter.counts() == {}
    destroy_grid(enc)
    destroy_grid(llm)
