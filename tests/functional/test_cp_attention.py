"""context_parallel_attention vs one-process full-sequence attention: 8 ranks (CP 1, 2, 4,
TP heads, SP), 6 ranks (packed CP 3 with GQA) and 4 ranks (CP 4, plain and packed).

Oracle: ``torch.nn.functional.scaled_dot_product_attention`` on the full tensors (per
sequence for packed input), computed on every rank from the same seed. Tokens are cut
with an independent reference (``chunk(2·cp)``, keep chunks i and 2·cp−1−i).

Tolerance (fp32): the CP result sums the softmax over keys in a permuted order and the
K/V gradients through a reduce-scatter, so it differs from the oracle by float rounding
only (~1e-7 relative per op over a few dozen terms). Measured on gloo: max abs error
1.2e-6 (plain / packed), 2.9e-6 (TP layer gradients, values up to ~10), i.e. <= 3.3e-7
relative to the largest value; ``atol = rtol = 1e-5`` leaves a 3-30x margin while any
masking or layout bug gives O(0.1) errors.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from mp_bridge.comm import PartitionAdapter, gather_along, reduce_scatter_along
from mp_bridge.comm.collectives.primitives import copy_to_group, reduce_from_group
from mp_bridge.layers import context_parallel_attention
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import cu_of, rand, ref_cut, reference_attention, tp_cp_groups

world = DistributedWorld(8)
CP_SIZES = (1, 2, 4)
PACKED_LENGTHS = (8, 24, 16)  # three different lengths, each a multiple of 2·cp = 8
TOL = dict(rtol=1e-5, atol=1e-5)  # see module docstring


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


def _check_against_oracle(cp, lengths, *, hq=4, hk=4, causal=True, restart_positions=False):
    cp_g, _, r, _ = tp_cp_groups(cp)
    b, s, d = (2, 16, 8) if lengths is None else (1, sum(lengths), 8)
    cu = None if lengths is None else cu_of(lengths)
    full = [rand(b, s, h, d, seed=i).requires_grad_() for i, h in enumerate((hq, hk, hk))]
    grad_out = rand(b, s, hq, d, seed=10)
    ref = reference_attention(*full, lengths, causal)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), full)

    adapter = PartitionAdapter(cp_group=cp_g)
    shards = [adapter.shard(t, cu_seqlens=cu) for t in full]
    pos = shards[0].position_ids
    if restart_positions:  # per-sequence RoPE-style positions must give the same mask
        starts = torch.tensor(cu[:-1]).repeat_interleave(torch.tensor(lengths))
        pos = ref_cut(torch.arange(s) - starts, 0, cp, r, lengths).to(pos.device)
    q, k, v = (sh.embeddings for sh in shards)
    out = context_parallel_attention(
        q, k, v, cp_group=cp_g, position_ids=pos if causal else None, causal=causal, cu_seqlens=cu
    )
    torch.testing.assert_close(out, ref_cut(ref, 1, cp, r, lengths), **TOL)
    (out * ref_cut(grad_out, 1, cp, r, lengths)).sum().backward()
    # Each rank's full-tensor gradient is zero outside its own tokens; summed over CP it is
    # the full gradient.
    for t, g in zip(full, ref_grads):
        torch.testing.assert_close(_sum_over(t.grad, cp_g), g, **TOL)


@world.case
def test_matches_full_sequence_causal_attention():
    for cp in CP_SIZES:
        _check_against_oracle(cp, None)


@world.case
def test_packed_three_sequences():
    for cp in CP_SIZES:
        _check_against_oracle(cp, PACKED_LENGTHS)
        _check_against_oracle(cp, PACKED_LENGTHS, restart_positions=True)


@world.case
def test_non_causal_and_grouped_query():
    _check_against_oracle(2, None, causal=False)
    _check_against_oracle(4, PACKED_LENGTHS, causal=False)
    _check_against_oracle(2, None, hq=4, hk=2)


def _tp_attention_layer(x_cp, weights, cp_g, tp_g, t, position_ids, sp):
    """A TP attention block: column-parallel QKV (heads split), CP attention, row-parallel
    output. With SP the input is SP-split (all-gather in, reduce-scatter out)."""
    wq, wk, wv, wo = weights
    hidden = wq.shape[0]
    cols = slice(t * hidden // 2, (t + 1) * hidden // 2)  # heads t·h/2 .. (t+1)·h/2
    x = gather_along(x_cp, tp_g, 1) if sp else copy_to_group(x_cp, tp_g)
    b, s, _ = x.shape
    q, k, v = ((x @ w[:, cols]).view(b, s, -1, 4) for w in (wq, wk, wv))  # head dim 4
    out = context_parallel_attention(q, k, v, cp_group=cp_g, position_ids=position_ids)
    partial = out.reshape(b, s, -1) @ wo[cols, :]
    return reduce_scatter_along(partial, tp_g, 1) if sp else reduce_from_group(partial, tp_g)


@world.case
def test_tp2_heads_split_with_and_without_sequence_parallel():
    b, s, hidden, heads = 2, 16, 16, 4
    for cp in CP_SIZES:
        cp_g, tp_g, r, t = tp_cp_groups(cp)
        for sp in (False, True):
            x = rand(b, s, hidden, seed=20).requires_grad_()
            ws = [
                rand(hidden, hidden, seed=21 + i, scale=1 / math.sqrt(hidden)).requires_grad_()
                for i in range(4)
            ]
            grad_out = rand(b, s, hidden, seed=30)
            # One process, full sequence, all heads.
            q, k, v = ((x @ w).view(b, s, heads, 4) for w in ws[:3])
            ref = reference_attention(q, k, v).reshape(b, s, hidden) @ ws[3]
            ref_grads = torch.autograd.grad((ref * grad_out).sum(), [x, *ws])

            adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
            batch = adapter.shard(x)
            y = _tp_attention_layer(batch.embeddings, ws, cp_g, tp_g, t, batch.position_ids, sp)
            tp = 2 if sp else 1
            torch.testing.assert_close(y, ref_cut(ref, 1, cp, r, None, tp, t), **TOL)
            (y * ref_cut(grad_out, 1, cp, r, None, tp, t)).sum().backward()
            # x.grad: own CP tokens (identical on both TP ranks); weights: own TP columns /
            # rows, partial over CP tokens. Summing over CP (and TP for weights) = full.
            torch.testing.assert_close(_sum_over(x.grad, cp_g), ref_grads[0], **TOL)
            for w, g in zip(ws, ref_grads[1:]):
                torch.testing.assert_close(_sum_over(_sum_over(w.grad, cp_g), tp_g), g, **TOL)


@world.case
def test_bf16_accumulates_in_fp32():
    cp_g, _, r, _ = tp_cp_groups(2)
    full = [rand(2, 16, 2, 8, seed=40 + i).to(torch.bfloat16) for i in range(3)]
    # Oracle in fp32 on the same bf16-rounded inputs: the only extra error is rounding the
    # output to bf16 (relative 2^-8 ~ 4e-3 of values <= ~2 in size).
    ref = reference_attention(*(t.float() for t in full))
    adapter = PartitionAdapter(cp_group=cp_g)
    shards = [adapter.shard(t) for t in full]
    out = context_parallel_attention(
        *(sh.embeddings for sh in shards), cp_group=cp_g, position_ids=shards[0].position_ids
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_cut(ref, 1, 2, r), rtol=8e-3, atol=8e-3)


@world.case
def test_one_all_gather_forward_one_reduce_scatter_backward():
    for cp in CP_SIZES:
        cp_g, _, _, _ = tp_cp_groups(cp)
        q, k, v = (rand(2, 16 // cp, 2, 4, seed=50 + i).requires_grad_() for i in range(3))
        pos = torch.arange(16 // cp, device=q.device)
        with CollectiveCounter() as fwd:
            out = context_parallel_attention(q, k, v, cp_group=cp_g, position_ids=pos)
        with CollectiveCounter() as bwd:
            out.sum().backward()
        expected = ({}, {}) if cp == 1 else ({"all_gather": 1}, {"reduce_scatter": 1})
        assert (fwd.counts(), bwd.counts()) == expected, cp
        if cp > 1:  # K, V (fp32) and int64 positions in one buffer
            per_rank = 2 * q.numel() * 4 + pos.numel() * 8
            assert fwd.calls[0].bytes_received == per_rank * (cp - 1)


@world.case
def test_bad_input_raises_before_any_collective():
    cp_g, _, _, _ = tp_cp_groups(2)
    dev = current_device()
    q = torch.zeros(1, 8, 2, 4, device=dev)
    pos = torch.arange(8, device=dev)
    attn = functools.partial(context_parallel_attention, cp_group=cp_g)
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"q has shape \(8, 2, 4\); expected \[b, s_local"):
            attn(q[0], q, q, position_ids=pos)
        with pytest.raises(ValueError, match=r"must agree on b, s_local and d"):
            attn(q, q[:, :4], q[:, :4], position_ids=pos)
        with pytest.raises(ValueError, match=r"q heads=2 must be a multiple of k/v heads=3"):
            kv = torch.zeros(1, 8, 3, 4, device=dev)
            attn(q, kv, kv, position_ids=pos)
        with pytest.raises(ValueError, match=r"position_ids has shape \(7,\); expected \[1, 8\]"):
            attn(q, q, q, position_ids=pos[:7])
        with pytest.raises(TypeError, match=r"position_ids has dtype torch.float32"):
            attn(q, q, q, position_ids=pos.float())
        with pytest.raises(ValueError, match=r"position_ids=None needs causal=False"):
            attn(q, q, q, position_ids=None)
        with pytest.raises(ValueError, match=r"packed input .* needs b == 1"):
            q2 = torch.zeros(2, 8, 2, 4, device=dev)
            attn(q2, q2, q2, position_ids=pos, cu_seqlens=[0, 8, 16])
        with pytest.raises(ValueError, match=r"2·cp=4; lengths \[6, 2\] are not"):
            attn(q, q, q, position_ids=pos, cu_seqlens=[0, 8, 14, 16])
        with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=8 must equal .* 16"):
            attn(q, q, q, position_ids=pos, cu_seqlens=[0, 8])
    assert counter.counts() == {}


# ------------------------------------------------------------------ 6 ranks: CP 3
def _attention_mismatches(cp, lengths, *, hq, hk):
    """CP attention on packed input vs the one-process reference: out and q/k/v grads."""
    cp_g = tp_cp_groups(cp)[0] if cp > 1 else None
    r = 0 if cp_g is None else dist.get_rank(cp_g)
    s, cu = sum(lengths), cu_of(lengths)
    full = [rand(1, s, h, 4, seed=10 + i).requires_grad_() for i, h in enumerate((hq, hk, hk))]
    grad_out = rand(1, s, hq, 4, seed=20)
    ref = reference_attention(*full, lengths)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), full)
    adapter = PartitionAdapter(cp_group=cp_g)
    shards = [adapter.shard(x, cu_seqlens=torch.tensor(cu, device=x.device)) for x in full]
    q, k, v = (sh.embeddings for sh in shards)
    out = context_parallel_attention(
        q, k, v, cp_group=cp_g, position_ids=shards[0].position_ids, cu_seqlens=cu
    )
    bad = []
    if not torch.allclose(out, ref_cut(ref, 1, cp, r, lengths), **TOL):
        bad.append(f"cp={cp} lengths={lengths}: output")
    (out * ref_cut(grad_out, 1, cp, r, lengths)).sum().backward()
    for name, x, g in zip("qkv", full, ref_grads):
        got = x.grad.clone()
        if cp_g is not None:  # each rank holds its own tokens' part; the sum is the full grad
            dist.all_reduce(got, group=cp_g)
        if not torch.allclose(got, g, **TOL):
            bad.append(f"cp={cp} lengths={lengths}: d{name}")
    return bad


@world.case(world_size=6)
def test_attention_packed_cp3_gqa_and_no_group_odd_lengths():
    bad = _attention_mismatches(3, (6, 18, 12), hq=4, hk=2)
    bad += _attention_mismatches(1, (5, 7, 3), hq=2, hk=2)  # no CP group: any lengths
    assert not bad, bad


@world.case(world_size=6)
def test_attention_mixed_dtypes_rejected_before_any_collective():
    cp_g = tp_cp_groups(3)[0]
    q = torch.zeros(1, 4, 2, 4, device=current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(TypeError, match=r"q torch.float32, k torch.bfloat16.*k.to\(q.dtype"):
            context_parallel_attention(
                q, q.bfloat16(), q, cp_group=cp_g, position_ids=torch.arange(4, device=q.device)
            )
    assert counter.counts() == {}


# ------------------------------------------------------------------ 4 ranks: CP 4
@world.case(world_size=4)
def test_cp_attention_cp4_plain_and_packed_matches_one_process():
    cp_g, _, r, _ = tp_cp_groups(4, tp=1)
    bad = []
    for causal in (True, False):
        for lengths in (None, [8, 16, 24]):
            seq, b = (48, 1) if lengths else (16, 2)
            q, k, v = (rand(b, seq, 4, 8, seed=s).requires_grad_() for s in (10, 11, 12))
            ref = reference_attention(q, k, v, lengths, causal)
            g_out = rand(*ref.shape, seed=13)
            grads = torch.autograd.grad((ref * g_out).sum(), (q, k, v))
            cu = None if lengths is None else [0, 8, 24, 48]
            idx = ref_cut(torch.arange(seq, device=q.device), 0, 4, r, lengths)  # independent cut
            local = [t.detach().index_select(1, idx).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(
                *local, cp_group=cp_g, position_ids=idx, causal=causal, cu_seqlens=cu
            )
            (out * g_out.index_select(1, idx)).sum().backward()
            pairs = [("out", out, ref)] + [(n, t.grad, g) for n, t, g in zip("qkv", local, grads)]
            for name, got, full in pairs:
                if not torch.allclose(got, full.detach().index_select(1, idx), **TOL):
                    bad.append(f"causal={causal} lengths={lengths}: {name}")
    assert not bad, bad
