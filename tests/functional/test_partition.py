"""PartitionAdapter in an 8-rank world: CP in {1, 2, 4}, with and without SP at TP 2.

The oracle for every sharded tensor is an independent reference cut: ``tensor.chunk(2·cp)``
and keep chunks ``i`` and ``2·cp−1−i`` (per sequence when packed), then ``chunk(tp)`` for SP.
Shard / unshard only move values, so values and ``shard``'s gradients compare exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_comm_reference import cu_of, rand, ref_cut, tp_cp_groups

from mp_bridge.comm import PartitionAdapter
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device

world = DistributedWorld(8)
CP_SIZES = (1, 2, 4)
PACKED_LENGTHS = (8, 24, 16)  # three sequences, each a multiple of 2·cp·tp = 16 at most


def _configs():
    for cp in CP_SIZES:
        for sp in (False, True):
            for lengths in (None, PACKED_LENGTHS):
                yield cp, sp, lengths


@world.case
def test_groups_created():
    for cp in CP_SIZES:
        cp_g, tp_g, _, _ = tp_cp_groups(cp)
        assert dist.get_world_size(cp_g) == cp and dist.get_world_size(tp_g) == 2


@world.case
def test_shard_matches_reference_cut():
    for cp, sp, lengths in _configs():
        cp_g, tp_g, r, t = tp_cp_groups(cp)
        b, s, h = (2, 16, 3) if lengths is None else (1, sum(lengths), 3)
        emb = rand(b, s, h, seed=1)
        labels = torch.arange(b * s, device=emb.device).view(b, s)
        mask = rand(b, s, seed=2) > 0
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
        cu = None if lengths is None else cu_of(lengths)
        out = adapter.shard(emb, labels=labels, loss_mask=mask, cu_seqlens=cu)
        tp = 2 if sp else 1
        assert torch.equal(out.embeddings, ref_cut(emb, 1, cp, r, lengths, tp, t))
        assert torch.equal(out.labels, ref_cut(labels, 1, cp, r, lengths))
        assert torch.equal(out.loss_mask, ref_cut(mask, 1, cp, r, lengths))
        # Default positions are the original ones, [b, S/cp]; they are never SP-split.
        pos = torch.arange(s, device=emb.device).expand(b, s)
        assert torch.equal(out.position_ids, ref_cut(pos, 1, cp, r, lengths))
        if lengths is None:
            assert out.cu_seqlens is None
        else:
            assert out.cu_seqlens.tolist() == cu
        # Given 1-D positions stay 1-D and are cut along dim 0.
        pos1 = torch.arange(100, 100 + s, device=emb.device)
        got = adapter.shard(emb, position_ids=pos1, cu_seqlens=cu).position_ids
        assert torch.equal(got, ref_cut(pos1, 0, cp, r, lengths))


@world.case
def test_unshard_inverts_shard_exactly():
    for cp, sp, lengths in _configs():
        cp_g, tp_g, _, _ = tp_cp_groups(cp)
        b, s = (2, 16) if lengths is None else (1, sum(lengths))
        cu = None if lengths is None else cu_of(lengths)
        emb = rand(b, s, 5, seed=3)
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
        out = adapter.shard(emb, labels=emb[..., 0], cu_seqlens=cu)
        assert torch.equal(adapter.unshard(out.embeddings, cu_seqlens=cu), emb)
        back = adapter.unshard(out.labels, cu_seqlens=cu, sequence_parallel=False)
        assert torch.equal(back, emb[..., 0])
        # [s, b, h] layout: seq_dim=0.
        sbh = emb.transpose(0, 1).contiguous()
        adapter0 = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp, seq_dim=0)
        local = adapter0.shard(sbh, cu_seqlens=cu).embeddings
        assert torch.equal(adapter0.unshard(local, cu_seqlens=cu), sbh)


@world.case
def test_shard_gradient_is_zero_padded():
    for cp, sp, lengths in _configs():
        cp_g, tp_g, r, t = tp_cp_groups(cp)
        b, s = (2, 16) if lengths is None else (1, sum(lengths))
        cu = None if lengths is None else cu_of(lengths)
        emb = rand(b, s, 4, seed=4).requires_grad_()
        weight = rand(b, s, 4, seed=5)
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
        local = adapter.shard(emb, cu_seqlens=cu).embeddings
        tp = 2 if sp else 1
        (local * ref_cut(weight, 1, cp, r, lengths, tp, t)).sum().backward()
        # Single-process gradient of sum(local * w) over this CP rank's tokens: w there, 0
        # elsewhere. With SP the TP all-gather fills in the other TP ranks' pieces.
        keep = ref_cut(torch.arange(s, device=emb.device), 0, cp, r, lengths)
        expected = torch.zeros_like(weight)
        expected[:, keep] = weight[:, keep]
        assert torch.equal(emb.grad, expected)


@world.case
def test_unshard_gradient_slice_and_sum():
    for cp, sp, lengths in _configs():
        cp_g, tp_g, r, t = tp_cp_groups(cp)
        b, s = (2, 16) if lengths is None else (1, sum(lengths))
        cu = None if lengths is None else cu_of(lengths)
        full = rand(b, s, 3, seed=6)
        tp = 2 if sp else 1
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)

        # "slice": every rank computes the same loss on the full tensor.
        x = ref_cut(full, 1, cp, r, lengths, tp, t).requires_grad_()
        weight = rand(b, s, 3, seed=7)
        (adapter.unshard(x, cu_seqlens=cu) * weight).sum().backward()
        assert torch.equal(x.grad, ref_cut(weight, 1, cp, r, lengths, tp, t))

        # "sum": rank (c, t') uses its own weight; the gradient is the sum over the ranks
        # the tensor was gathered from (CP x TP with SP, CP only without).
        x = ref_cut(full, 1, cp, r, lengths, tp, t).requires_grad_()
        own = rand(b, s, 3, seed=100 + 2 * r + t)
        (adapter.unshard(x, cu_seqlens=cu, grad="sum") * own).sum().backward()
        tps = range(2) if sp else [t]
        total = sum(rand(b, s, 3, seed=100 + 2 * c + u) for c in range(cp) for u in tps)
        # Sums of <= 8 N(0,1) fp32 values in different orders: a few ulp (~1e-6) apart.
        torch.testing.assert_close(
            x.grad, ref_cut(total, 1, cp, r, lengths, tp, t), rtol=1e-5, atol=1e-5
        )


@world.case
def test_collective_budget():
    cp_g, tp_g, _, _ = tp_cp_groups(2)
    emb = rand(2, 16, 4, seed=8).requires_grad_()
    adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=True)
    with CollectiveCounter() as fwd:
        local = adapter.shard(emb).embeddings
    with CollectiveCounter() as bwd:
        local.sum().backward()
    assert fwd.counts() == {} and bwd.counts() == {"all_gather": 1}
    with CollectiveCounter() as un:
        full = adapter.unshard(local.detach().requires_grad_())
    with CollectiveCounter() as un_bwd:
        full.sum().backward()
    assert un.counts() == {"all_gather": 2} and un_bwd.counts() == {}  # TP then CP


@world.case
def test_none_groups_are_single_process():
    emb = rand(2, 8, 4, seed=9)
    adapter = PartitionAdapter(sequence_parallel=True)
    with CollectiveCounter() as counter:
        out = adapter.shard(emb, labels=emb[..., 0])
        back = adapter.unshard(out.embeddings)
    assert counter.counts() == {}
    assert torch.equal(out.embeddings, emb) and torch.equal(back, emb)
    assert (adapter.cp_size, adapter.tp_size) == (1, 1)


@world.case
def test_bad_input_raises_before_any_collective():
    cp_g, tp_g, _, _ = tp_cp_groups(2)
    sp = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=True)
    cp_only = PartitionAdapter(cp_group=cp_g, tp_group=tp_g)
    dev = current_device()
    with CollectiveCounter() as counter:
        with pytest.raises(ValueError, match=r"=6 must be divisible by 2·cp=4 \(cp=2\)"):
            cp_only.shard(torch.zeros(1, 6, 2, device=dev))
        with pytest.raises(ValueError, match=r"=12 must be divisible by 2·cp·tp=8"):
            sp.shard(torch.zeros(1, 12, 2, device=dev))
        with pytest.raises(ValueError, match=r"by 2·cp=4; lengths \[6, 2\] are not"):
            cp_only.shard(torch.zeros(1, 12, 2, device=dev), cu_seqlens=[0, 4, 10, 12])
        with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=8 must equal .* 12"):
            cp_only.shard(torch.zeros(1, 12, 2, device=dev), cu_seqlens=[0, 8])
        with pytest.raises(ValueError, match=r"labels has shape \(2, 7\); expected \[2, 8\]"):
            cp_only.shard(torch.zeros(2, 8, 2, device=dev), labels=torch.zeros(2, 7))
        with pytest.raises(ValueError, match=r"seq_dim=3 is out of range"):
            PartitionAdapter(seq_dim=3).shard(torch.zeros(2, 8, 2, device=dev))
        with pytest.raises(ValueError, match=r"grad='mean'"):
            cp_only.unshard(torch.zeros(1, 4, device=dev), grad="mean")
        with pytest.raises(ValueError, match=r"local 3 x ranks\)=6 must be divisible by 2·cp=4"):
            cp_only.unshard(torch.zeros(1, 3, device=dev))
    assert counter.counts() == {}


@world.case
def test_no_global_parallel_state():
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
