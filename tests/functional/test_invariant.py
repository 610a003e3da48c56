"""TP-invariant cross-entropy / log-probs over materialized vocab-parallel logits, 8 ranks.

One full logits tensor (same seed on every rank) is split at TP 1, 2, 3, 4, 8 with the
block-aligned layout ``vocab_shard_ranges(V, tp, multiple=256)``; the oracle is
``F.cross_entropy`` / ``log_softmax`` on the full logits in one process. On a 6-rank world,
TP 1 on the caller's *unpadded* tensors gives the same bits as TP 2, 3, 5, 6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
    vocab_shard_size,
)
from mp_bridge.layers.loss.blocks import TOKEN_TILE
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.loss_refs import Checks
from tests.oracles import gather_rows, rank_in, tp_group, tp_member, vocab_cut

world = DistributedWorld(8, timeout_s=120)
VOCAB = 2500  # 10 blocks of 256; the last one holds 196 true ids


def _full(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, 4096, generator=g) * 3).to(current_device(), dtype)
    target = torch.randint(0, VOCAB, (n,), generator=g).to(current_device())
    target[[2, 5]] = -100
    return logits, target


def _local(full, tp, rank):
    start, end = vocab_shard_ranges(VOCAB, tp, multiple=256)[rank]
    return full[:, start:end].detach().clone(), start


def _same_cols(checks, grad, base_grad, start, what):
    """This rank's grad columns equal the TP = 1 ones (which end at its padded width)."""
    width = max(0, min(grad.shape[1], base_grad.shape[1] - start))
    checks.equal(grad[:, :width], base_grad[:, start : start + width], what)
    checks.equal(grad[:, width:], torch.zeros_like(grad[:, width:]), what + " (padding)")


def _call(kind, logits, target, group):
    x = logits.clone().requires_grad_(True)
    if kind == "ce":
        out = vocab_parallel_cross_entropy(
            x,
            target,
            tp_group=group,
            vocab_size=VOCAB,
            ignore_index=-100,
            label_smoothing=0.1,
            invariant=True,
        )
    else:
        out = vocab_parallel_logprobs(
            x,
            target.clamp(min=0),
            tp_group=group,
            vocab_size=VOCAB,
            temperature=0.8,
            invariant=True,
        )
    up = torch.linspace(0.5, 1.5, out.shape[0], device=out.device)
    out.backward(up)
    return out.detach(), x.grad


def _oracle(kind, full, target):
    x = full[:, :VOCAB].float().clone().requires_grad_(True)
    if kind == "ce":
        out = F.cross_entropy(x, target, ignore_index=-100, label_smoothing=0.1, reduction="none")
    else:
        out = torch.log_softmax(x / 0.8, -1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    out.backward(torch.linspace(0.5, 1.5, out.shape[0], device=out.device))
    return out.detach(), x.grad


@world.case
def test_matches_full_vocab_oracle_and_is_bitwise_acrosstp_member():
    full, target = _full(150)  # 3 token tiles, the last one partial
    checks = Checks()
    for kind in ("ce", "lp"):
        ref_out, ref_grad = _oracle(kind, full, target)
        base_out, base_grad = _call(kind, _local(full, 1, 0)[0], target, None)
        # fp32: blocked online log-sum-exp vs torch's one pass reorders fp32 sums of
        # <= 2500 terms: ~1e-6 relative. 1e-5 would still catch any wrong term.
        checks.close(base_out, ref_out, f"{kind} value", rtol=1e-5, atol=1e-5)
        checks.close(base_grad[:, :VOCAB], ref_grad, f"{kind} grad", rtol=1e-5, atol=1e-6)
        checks.equal(base_grad[:, VOCAB:], torch.zeros_like(base_grad[:, VOCAB:]), "padding")
        for tp in (2, 3, 4, 8):
            inside, group, rank = tp_member(tp)
            if not inside:
                continue
            local, start = _local(full, tp, rank)
            out, grad = _call(kind, local, target, group)
            checks.equal(out, base_out, f"{kind} tp={tp} value")
            _same_cols(checks, grad, base_grad, start, f"{kind} tp={tp} grad")
    checks.done()


@world.case
def test_bf16_logits_bitwise_across_tp_and_close_to_oracle():
    full, target = _full(70, torch.bfloat16)
    checks = Checks()
    ref_out, ref_grad = _oracle("ce", full, target)
    base_out, base_grad = _call("ce", _local(full, 1, 0)[0], target, None)
    # Both see the same bf16 logits upcast to fp32: only fp32 summation order differs.
    checks.close(base_out, ref_out, "bf16 value", rtol=1e-5, atol=1e-5)
    # Gradients come back in bf16 (8 mantissa bits): 1 % relative.
    checks.close(base_grad[:, :VOCAB].float(), ref_grad, "bf16 grad", rtol=1e-2, atol=1e-4)
    for tp in (2, 4, 8):
        inside, group, rank = tp_member(tp)
        local, start = _local(full, tp, rank)
        out, grad = _call("ce", local, target, group)
        checks.equal(out, base_out, f"bf16 tp={tp} value")
        _same_cols(checks, grad, base_grad, start, f"bf16 tp={tp} grad")
    checks.done()


@world.case
def test_batch_invariance_with_unrelated_tokens():
    full, target = _full(100)
    extra, extra_t = _full(90, seed=4)
    inside, group, rank = tp_member(4)
    ref_out, ref_grad = _call("lp", _local(full, 4, rank)[0], target, group)
    checks = Checks()
    for logits, t, base in (
        (torch.cat([full, extra]), torch.cat([target, extra_t]), slice(0, 100)),
        (torch.cat([extra, full]), torch.cat([extra_t, target]), slice(90, 190)),
    ):
        x = _local(logits, 4, rank)[0].requires_grad_(True)
        out = vocab_parallel_logprobs(
            x, t.clamp(min=0), tp_group=group, vocab_size=VOCAB, temperature=0.8, invariant=True
        )
        up = torch.zeros(out.shape[0], device=out.device)
        up[base] = torch.linspace(0.5, 1.5, 100, device=out.device)
        out.backward(up)
        checks.equal(out.detach()[base], ref_out, f"value, base tokens at {base}")
        checks.equal(x.grad[base], ref_grad, f"grad, base tokens at {base}")
    checks.done()


@world.case
def test_one_all_gather_forward_none_backward():
    full, target = _full(150)
    inside, group, rank = tp_member(8)
    x = _local(full, 8, rank)[0].requires_grad_(True)
    with CollectiveCounter() as fwd:
        out = vocab_parallel_cross_entropy(
            x, target, tp_group=group, vocab_size=VOCAB, ignore_index=-100, invariant=True
        )
    with CollectiveCounter() as bwd:
        out.sum().backward()
    assert fwd.counts() == {"all_gather": 1} and bwd.counts() == {}
    # 2 blocks per rank, 5 of 8 ranks hold real blocks ([0,2),[2,4),[4,6),[6,8),[8,10)):
    # one subtree each (P = 1); [1, tiles, 4, TOKEN_TILE] fp32 from each of 7 peers.
    tiles = -(-150 // TOKEN_TILE)
    assert fwd.bytes_received("all_gather") == 7 * tiles * 4 * TOKEN_TILE * 4


@world.case
def test_unaligned_shard_is_a_clear_error():
    full, target = _full(8)
    inside, group, rank = tp_member(2)
    start, end = vocab_shard_ranges(VOCAB, 2)[rank]  # 1250 rows: not a multiple of 256
    with pytest.raises(
        ValueError,
        match=r"multiple of 256 rows, got 1250 rows.*"
        r"vocab_shard_ranges\(vocab_size, tp_size, multiple=256\)",
    ):
        vocab_parallel_logprobs(
            full[:, start:end],
            target.clamp(min=0),
            tp_group=group,
            vocab_size=VOCAB,
            temperature=1.0,
            invariant=True,
        )


@world.case(world_size=6)
def test_invariant_bitwise_tp1_unpadded_vs_tp2_3_5_6():
    vocab, n = 1001, 70
    gen, dev = torch.Generator().manual_seed(5), current_device()
    weight = (torch.randn(vocab, 16, generator=gen) / 4).to(dev)
    hidden = torch.randn(n, 16, generator=gen).to(dev)
    target = torch.randint(0, vocab, (n,), generator=gen).to(dev)
    padded = torch.cat([weight, weight.new_zeros(1024 - vocab, 16)])
    logits = hidden @ padded.t()  # one full logits tensor, split at every TP size
    results = {}
    for tp in (1, 2, 3, 5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        # TP 1: the caller's unpadded tensors; TP > 1: the multiple=256 layout.
        w0 = (
            weight
            if tp == 1
            else vocab_cut(padded, vocab_shard_size(vocab, tp, multiple=256), rank, 0)
        )
        z0 = (
            logits[:, :vocab]
            if tp == 1
            else vocab_cut(logits, vocab_shard_size(vocab, tp, multiple=256), rank, -1)
        )
        w, h = w0.clone().requires_grad_(), hidden.clone().requires_grad_()
        lp = fused_linear_logprobs(
            h, w, target, tp_group=group, vocab_size=vocab, chunk_size=29, invariant=True
        )
        lp.sum().backward()
        z = z0.clone().requires_grad_()
        ce = vocab_parallel_cross_entropy(
            z, target, tp_group=group, vocab_size=vocab, label_smoothing=0.1, invariant=True
        )
        ce.sum().backward()
        grad_z = gather_rows(z.grad.t(), group, tp)[:vocab]
        outs = (lp, h.grad, gather_rows(w.grad, group, tp)[:vocab], ce, grad_z)
        results[tp] = tuple(t.detach().cpu() for t in outs)  # compared across ranks, on CPU
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    merged = {tp: r for rank_results in everyone for tp, r in rank_results.items()}
    assert sorted(merged) == [1, 2, 3, 5, 6]
    for tp in (2, 3, 5, 6):
        for i, (a, b) in enumerate(zip(merged[1], merged[tp])):
            assert torch.equal(a, b), f"TP {tp} output {i} differs from TP 1"


def _fused_run(kind, hidden, weight, target, upstream, chunk, group, vocab):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kw = dict(tp_group=group, vocab_size=vocab, invariant=True, chunk_size=chunk)
    if kind == "logprobs":
        out = fused_linear_logprobs(h, w, target, **kw)
    else:
        out = fused_linear_cross_entropy(h, w, target, reduction="none", z_loss_weight=1e-3, **kw)
    out.backward(upstream)
    return out.detach(), h.grad


@world.case
def test_fused_any_order_and_split_same_bits_tp1_2_4():
    """Per-token values and d hidden are bitwise the same at TP 1, 2, 4 for the tokens in
    order in one call and for any permutation split into two calls with other chunk sizes
    (seeded random cases, odd and even N, H, V; the reference is TP 1, in order)."""
    gen = torch.Generator().manual_seed(23)
    checks = Checks()
    for case in range(6):
        n = int(torch.randint(1, 160, (1,), generator=gen))
        h_dim = (7, 16, 33, 48, 5, 20)[case]
        vocab = int(torch.randint(2, 2900, (1,), generator=gen))
        dev = current_device()  # drawn on the CPU, then moved: the same values everywhere
        weight = (torch.randn(vocab, h_dim, generator=gen) / h_dim**0.5).to(dev)
        hidden = (torch.randn(n, h_dim, generator=gen) * 2).to(dev)
        target = torch.randint(0, vocab, (n,), generator=gen).to(dev)
        upstream = (torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) > 0.2)).to(dev)
        perm = torch.randperm(n, generator=gen).to(dev)
        cut = int(torch.randint(0, n + 1, (1,), generator=gen))
        kind = ("logprobs", "ce")[case % 2]
        ref = _fused_run(kind, hidden, weight, target, upstream, 40, None, vocab)
        for tp in (1, 2, 4):
            inside, group, rank = tp_member(tp)
            w_local = vocab_cut(weight, vocab_shard_size(vocab, tp, multiple=256), rank, 0)
            where = f"case {case} (n={n}, H={h_dim}, V={vocab}, {kind}) tp={tp}"
            for part, chunk in ((perm[:cut], 64), (perm[cut:], 200)):
                if part.numel() == 0:
                    continue
                args = (hidden[part], w_local, target[part], upstream[part], chunk, group, vocab)
                out, gh = _fused_run(kind, *args)
                checks.equal(out, ref[0][part], f"{where} values")
                checks.equal(gh, ref[1][part], f"{where} d hidden")
    checks.done()
