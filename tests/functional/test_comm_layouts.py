"""Bridge, partition, CP attention and deterministic_all_reduce on a 6-rank world.

The other functional files use 8 ranks with power-of-two groups; this one uses sizes
that are not (DP ratio k = 3, CP = 3 and 6), grids on part of the world (``rank_offset``),
low-precision and non-default tensor layouts, and inputs the main files never name.

Oracles, as in the 8-rank files: every rank builds the full tensors from one seed and
compares with plain indexing / single-process math on them. Bridge, shard and unshard only
move values, so they compare exactly (``torch.equal``); attention compares at fp32
``atol = rtol = 1e-5`` (see ``test_cp_attention.py``: measured errors are ~1e-6). Cases
with many collectives collect mismatches and assert at the end, so a failing rank never
leaves the others waiting in a collective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_comm_reference import (
    FLAT,
    SBH,
    bridge_mismatches,
    cu_of,
    rand,
    ref_cut,
    reference_attention,
    tp_cp_groups,
)

from mp_bridge.comm import (
    BridgeDirection,
    ColocatedBridgeCommunicator,
    PartitionAdapter,
    deterministic_all_reduce,
)
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.layers import context_parallel_attention
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device

world = DistributedWorld(6, timeout_s=120)
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 attention, see module docstring


# ------------------------------------------------------------------------- bridge
@world.case
def test_bridge_layouts_of_six_ranks():
    bad = []
    # EQUAL, dest CP 2, dest TP < src TP.
    bad += bridge_mismatches(dict(tp=2, dp=3), dict(tp=1, cp=2, dp=3), batch=3, seq=8)
    # FAN_IN k=3, dest TP > src TP, bf16, one sample per src rank.
    bad += bridge_mismatches(
        dict(tp=1, dp=6), dict(tp=2, dp=3), batch=6, seq=4, dtype=torch.bfloat16
    )
    # FAN_IN k=3 into CP 6, [s, b, h] input (batch on dim 1).
    bad += bridge_mismatches(dict(tp=2, dp=3), dict(tp=1, cp=6, dp=1), batch=3, seq=12, mapping=SBH)
    # FAN_OUT k=3 with dest CP 2, fp16.
    bad += bridge_mismatches(
        dict(tp=6, dp=1), dict(tp=1, cp=2, dp=3), batch=3, seq=4, dtype=torch.float16
    )
    # FAN_OUT k=3, src local batch == k, flattened (b*s, h).
    bad += bridge_mismatches(dict(tp=3, dp=2), dict(tp=1, dp=6), batch=6, seq=4, mapping=FLAT)
    # dp fastest in both grids (rank = dp + 3·tp and rank = dp + 3·cp) still nests.
    bad += bridge_mismatches(
        dict(tp=2, dp=3),
        dict(tp=1, cp=2, dp=3),
        batch=3,
        seq=4,
        src_order=("dp", "tp", "cp", "pp"),
        dest_order=("dp", "cp", "tp", "pp"),
    )
    assert not bad, bad


@world.case
def test_bridge_grids_on_part_of_the_world():
    bad = []
    # Ranks 2-5: FAN_IN k=2; ranks 1-4: FAN_OUT k=2 with dest CP 2 ([s, b, h] input).
    bad += bridge_mismatches(dict(tp=1, dp=4), dict(tp=2, dp=2), batch=4, seq=4, offset=2)
    bad += bridge_mismatches(
        dict(tp=4, dp=1), dict(tp=1, cp=2, dp=2), batch=2, seq=4, offset=1, mapping=SBH
    )
    assert not bad, bad


@world.case
def test_bridge_without_autograd_and_batch_dim_errors():
    device = current_device()
    src_grid = make_grid(tp=6, dp=1, create=())
    dest_grid = make_grid(tp=1, cp=2, dp=3, create=("cp",))
    x = rand(3, 4, 2, seed=3).transpose(0, 1)  # [s, b, h] view, batch 3 on dim 1
    with ColocatedBridgeCommunicator(src_grid, dest_grid, dim_mapping=SBH) as bridge:
        assert bridge.direction is BridgeDirection.FAN_OUT and bridge.scale == 3
        slot = GridLayout.from_grid(dest_grid).coords(dist.get_rank())["dp"]
        with torch.no_grad():
            y = bridge.communicate(x)
        assert not y.requires_grad and torch.equal(y, x[:, slot : slot + 1])
        assert torch.equal(bridge.communicate(x), y)  # input without requires_grad
        with CollectiveCounter() as counter:
            with pytest.raises(ValueError, match=r"batch size 4 \(dim 1 of shape .* by 3"):
                bridge.communicate(torch.zeros(4, 4, 2, device=device))
        assert counter.counts() == {}


# ---------------------------------------------------------------------- partition
@world.case
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


@world.case
def test_partition_packed_cu_seqlens_forms_and_2d_tokens():
    cp_g, tp_g, r, _ = tp_cp_groups(3)
    lengths = (6, 18, 12)  # multiples of 2·cp = 6
    cu = cu_of(lengths)
    tokens = rand(36, 4, seed=5)  # packed [T, h], sequence on dim 0
    adapter = PartitionAdapter(cp_group=cp_g, seq_dim=0)
    bad = []
    forms = (cu, torch.tensor(cu, dtype=torch.int32), np.array(cu), tuple(cu))
    for form in forms:
        out = adapter.shard(tokens, labels=torch.arange(36), cu_seqlens=form)
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
        if not torch.equal(adapter.unshard(out.labels, cu_seqlens=form), torch.arange(36)):
            bad.append(f"{type(form).__name__}: unshard(labels) is not the labels")
    assert not bad, bad


@world.case
def test_partition_without_cp_takes_any_length():
    # cp = 1 (no group): nothing to balance, so odd and packed odd lengths are fine.
    emb = rand(2, 7, 3, seed=6)
    adapter = PartitionAdapter()
    out = adapter.shard(emb, labels=torch.arange(14).view(2, 7))
    assert torch.equal(out.embeddings, emb)
    assert torch.equal(out.position_ids, torch.arange(7, device=emb.device).expand(2, 7))
    assert torch.equal(adapter.unshard(out.embeddings), emb)
    packed = adapter.shard(emb[:1], cu_seqlens=[0, 3, 7])
    assert torch.equal(packed.embeddings, emb[:1])
    # With SP at tp=2 (and no CP) the length must be a multiple of tp only.
    _, tp_g, _, t = tp_cp_groups(1)
    sp = PartitionAdapter(tp_group=tp_g, sequence_parallel=True)
    assert torch.equal(sp.shard(emb[:, :6]).embeddings, emb[:, 3 * t : 3 * t + 3])
    with pytest.raises(ValueError, match=r"=7 must be divisible by cp·tp=2 \(cp=1, tp=2"):
        sp.shard(emb)


# ---------------------------------------------------------------------- attention
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
    shards = [adapter.shard(x, cu_seqlens=torch.tensor(cu)) for x in full]
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


@world.case
def test_attention_packed_cp3_gqa_and_no_group_odd_lengths():
    bad = _attention_mismatches(3, (6, 18, 12), hq=4, hk=2)
    bad += _attention_mismatches(1, (5, 7, 3), hq=2, hk=2)  # no CP group: any lengths
    assert not bad, bad


@world.case
def test_attention_mixed_dtypes_rejected_before_any_collective():
    cp_g = tp_cp_groups(3)[0]
    q = torch.zeros(1, 4, 2, 4, device=current_device())
    with CollectiveCounter() as counter:
        with pytest.raises(TypeError, match=r"q torch.float32, k torch.bfloat16.*k.to\(q.dtype"):
            context_parallel_attention(
                q, q.bfloat16(), q, cp_group=cp_g, position_ids=torch.arange(4)
            )
    assert counter.counts() == {}


# ------------------------------------------------------------ deterministic_all_reduce
@world.case
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
