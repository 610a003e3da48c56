"""PartitionAdapter: 8 ranks (CP in {1, 2, 4}, with and without SP at TP 2), 6 ranks
(CP 3, packed, ``[s, b, h]``) and 4 ranks (CP 2 × TP 2 against literal token lists).

The oracle for every sharded tensor is an independent reference cut (``tests.oracles.
ref_cut``): ``tensor.chunk(2·cp)`` and keep chunks ``i`` and ``2·cp−1−i`` (per sequence when
packed), then ``chunk(tp)`` for SP; on 4 ranks, token lists written out by hand. Shard /
unshard only move values, so values and ``shard``'s gradients compare exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mp_bridge.comm import PartitionAdapter
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import cu_of, rand, ref_cut, tp_cp_groups

world = DistributedWorld(8)
CP_SIZES = (1, 2, 4)
PACKED_LENGTHS = (8, 24, 16)  # three sequences, each a multiple of 2·cp·tp = 16 at most


def _configs():
    for cp in CP_SIZES:
        for sp in (False, True):
            for lengths in (None, PACKED_LENGTHS):
                yield cp, sp, lengths


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
        # Indivisible lengths are padded (tests/functional/test_partition_padding.py); a
        # gathered length that is not the padded original one is still an error.
        with pytest.raises(ValueError, match=r"seq_len=3 pads to 4 tokens but the gathered"):
            cp_only.unshard(torch.zeros(1, 4, device=dev), seq_len=3)
        with pytest.raises(ValueError, match=r"shard\(\) got no tensor"):
            sp.shard()
        with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=8 must equal .* 12"):
            cp_only.shard(torch.zeros(1, 12, 2, device=dev), cu_seqlens=[0, 8])
        with pytest.raises(ValueError, match=r"labels has shape \(2, 7\); expected \[2, 8\]"):
            cp_only.shard(torch.zeros(2, 8, 2, device=dev), labels=torch.zeros(2, 7, device=dev))
        with pytest.raises(ValueError, match=r"seq_dim=3 is out of range"):
            PartitionAdapter(seq_dim=3).shard(torch.zeros(2, 8, 2, device=dev))
        with pytest.raises(ValueError, match=r"grad='mean'"):
            cp_only.unshard(torch.zeros(1, 4, device=dev), grad="mean")
        with pytest.raises(ValueError, match=r"local 3 x ranks\)=6 must be divisible by 2·cp=4"):
            cp_only.unshard(torch.zeros(1, 3, device=dev))
    assert counter.counts() == {}


# ------------------------------------------------------------------ 6 ranks: CP 3
@world.case(world_size=6)
def test_partition_sp_tp2_cp3_unshards_per_token_tensors_by_default():
    cp_g, tp_g, r, t = tp_cp_groups(3)
    bad = []
    for seq_dim in (1, 0):
        emb = rand(2, 24, 5, seed=4)  # S = 24 = 2·cp·tp·2
        emb_in = emb if seq_dim == 1 else emb.transpose(0, 1)  # [s, b, h] view
        labels = torch.arange(48, device=emb.device).view(2, 24)
        adapter = PartitionAdapter(
            cp_group=cp_g, tp_group=tp_g, sequence_parallel=True, seq_dim=seq_dim
        )
        out = adapter.shard(emb_in, labels=labels)
        if not torch.equal(out.embeddings, ref_cut(emb_in, seq_dim, 3, r, tp=2, t=t)):
            bad.append(f"seq_dim={seq_dim}: embeddings are not the reference cut")
        if not torch.equal(out.labels, ref_cut(labels, 1, 3, r)):
            bad.append(f"seq_dim={seq_dim}: labels are not the CP cut")
        if not torch.equal(adapter.unshard(out.embeddings), emb_in):
            bad.append(f"seq_dim={seq_dim}: unshard(embeddings) is not the input")
        # Per-token tensors are never SP-split, and unshard knows it without being told.
        if not torch.equal(adapter.unshard(out.labels, seq_dim=1), labels):
            bad.append(f"seq_dim={seq_dim}: unshard(labels) is not the labels")
        positions = adapter.unshard(out.position_ids, seq_dim=1)
        if not torch.equal(positions, torch.arange(24, device=emb.device).expand(2, 24)):
            bad.append(f"seq_dim={seq_dim}: unshard(position_ids) is not arange(S)")
    assert not bad, bad


@world.case(world_size=6)
def test_partition_packed_cu_seqlens_forms_and_2d_tokens():
    cp_g, tp_g, r, _ = tp_cp_groups(3)
    lengths = (6, 18, 12)  # multiples of 2·cp = 6
    cu = cu_of(lengths)
    tokens = rand(36, 4, seed=5)  # packed [T, h], sequence on dim 0
    adapter = PartitionAdapter(cp_group=cp_g, seq_dim=0)
    bad = []
    dev = tokens.device
    forms = (cu, torch.tensor(cu, dtype=torch.int32, device=dev), np.array(cu), tuple(cu))
    labels = torch.arange(36, device=dev)
    for form in forms:
        out = adapter.shard(tokens, labels=labels, cu_seqlens=form)
        if not torch.equal(out.embeddings, ref_cut(tokens, 0, 3, r, lengths)):
            bad.append(f"{type(form).__name__}: embeddings are not the reference cut")
        # No batch dim: default positions are 1-D original positions.
        want = ref_cut(torch.arange(36, device=tokens.device), 0, 3, r, lengths)
        if not torch.equal(out.position_ids, want):
            bad.append(f"{type(form).__name__}: positions {tuple(out.position_ids.shape)}")
        if out.cu_seqlens.tolist() != cu:
            bad.append(f"{type(form).__name__}: cu_seqlens {out.cu_seqlens.tolist()}")
        if not torch.equal(adapter.unshard(out.embeddings, cu_seqlens=form), tokens):
            bad.append(f"{type(form).__name__}: unshard(embeddings) is not the input")
        if not torch.equal(adapter.unshard(out.labels, cu_seqlens=form), labels):
            bad.append(f"{type(form).__name__}: unshard(labels) is not the labels")
    assert not bad, bad


@world.case(world_size=6)
def test_partition_without_cp_takes_any_length():
    # cp = 1 (no group): nothing to balance, so odd and packed odd lengths are fine.
    emb = rand(2, 7, 3, seed=6)
    adapter = PartitionAdapter()
    out = adapter.shard(emb, labels=torch.arange(14, device=emb.device).view(2, 7))
    assert torch.equal(out.embeddings, emb)
    assert torch.equal(out.position_ids, torch.arange(7, device=emb.device).expand(2, 7))
    assert torch.equal(adapter.unshard(out.embeddings), emb)
    packed = adapter.shard(emb[:1], cu_seqlens=[0, 3, 7])
    assert torch.equal(packed.embeddings, emb[:1])
    assert packed.token_mask is None  # nothing padded
    # With SP at tp=2 (and no CP) the length is a multiple of tp, else padded to one.
    _, tp_g, _, t = tp_cp_groups(1)
    sp = PartitionAdapter(tp_group=tp_g, sequence_parallel=True)
    assert torch.equal(sp.shard(emb[:, :6]).embeddings, emb[:, 3 * t : 3 * t + 3])
    padded = torch.cat([emb, emb.new_zeros(2, 1, 3)], dim=1)  # 7 -> 8 tokens
    assert torch.equal(sp.shard(emb).embeddings, padded[:, 4 * t : 4 * t + 4])


# ------------------------------------------------------------------ 4 ranks: literal cut
# S = 16, cp = 2: four chunks of 4 tokens; CP rank 0 keeps chunks 0 and 3, rank 1 1 and 2.
CP2_TOKENS = {0: [0, 1, 2, 3, 12, 13, 14, 15], 1: [4, 5, 6, 7, 8, 9, 10, 11]}
# With SP at tp = 2 each TP rank keeps half of its CP rank's tokens.
CP2_SP2_TOKENS = {(0, 0): [0, 1, 2, 3], (0, 1): [12, 13, 14, 15], (1, 0): [4, 5, 6, 7]}
CP2_SP2_TOKENS[1, 1] = [8, 9, 10, 11]


@world.case(world_size=4)
def test_partition_cp2_sp_tp2_against_literal_token_lists():
    cp_g, tp_g, c, t = tp_cp_groups(2)  # rank = t + 2·c on 4 ranks
    bad, dev = [], current_device()
    for sp in (False, True):
        idx = torch.tensor(CP2_SP2_TOKENS[c, t] if sp else CP2_TOKENS[c], device=dev)
        cp_idx = torch.tensor(CP2_TOKENS[c], device=dev)
        adapter = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=sp)
        emb = rand(2, 16, 3, seed=4).requires_grad_()
        labels = torch.arange(32, device=dev).view(2, 16)
        out = adapter.shard(emb, labels=labels, loss_mask=torch.ones(2, 16, device=dev))
        if not torch.equal(out.embeddings, emb.detach()[:, idx]):
            bad.append(f"sp={sp}: embeddings are not tokens {idx.tolist()}")
        if not torch.equal(out.labels, labels[:, cp_idx]):
            bad.append(f"sp={sp}: labels are not tokens {cp_idx.tolist()}")
        if not torch.equal(out.position_ids, cp_idx.expand(2, -1)):
            bad.append(f"sp={sp}: position ids are not the original positions")
        if not torch.equal(adapter.unshard(out.embeddings), emb.detach()):
            bad.append(f"sp={sp}: unshard")
        w = rand(2, 16, 3, seed=5)
        (out.embeddings * w[:, idx]).sum().backward()
        # Zero-padded local gradient: w on this rank's CP tokens (with SP, the TP all-gather
        # brings the other TP rank's half), zero on the other CP rank's tokens.
        expected = torch.zeros(2, 16, 3, device=dev)
        expected[:, cp_idx] = w[:, cp_idx]
        if not torch.equal(emb.grad, expected):
            bad.append(f"sp={sp}: gradient is not the zero-padded local one")
    # S = 12 with SP is padded to 16 (zeros at 12..15): the same literal cut.
    emb12 = rand(2, 12, 3, seed=0)
    out = PartitionAdapter(cp_group=cp_g, tp_group=tp_g, sequence_parallel=True).shard(emb12)
    padded = torch.cat([emb12, torch.zeros(2, 4, 3, device=dev)], dim=1)
    if not torch.equal(out.embeddings, padded[:, CP2_SP2_TOKENS[c, t]]):
        bad.append("S=12 with SP: not the padded literal cut")
    assert not bad, bad
