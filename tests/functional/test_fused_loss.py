"""Fused LM-head loss on 8 ranks: oracle, materialized-op parity, bitwise invariance, budget.

Every rank builds the same full weight / hidden / targets from one seed, so the oracle
(``F.linear`` on the full weight + ``F.cross_entropy`` / ``log_softmax``) is computed in
one process on every rank. TP sizes 1, 2, 3, 4, 8 run on consecutive-rank groups
(TP = 3 on ranks 0-5; ranks 6, 7 sit those checks out); TP 5 and 6 on a 6-rank world.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mp_bridge.comm import copy_to_group
from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_shard_ranges,
    vocab_shard_size,
)
from mp_bridge.layers.loss.blocks import TOKEN_TILE
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import gather_rows, rank_in, tp_group, tp_member, vocab_cut

world = DistributedWorld(8, timeout_s=120)  # a failing rank must not hang CI for long
H = 16


def _data(n, vocab, dtype=torch.float32, seed=0, ignored=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    dev = current_device()
    hidden = torch.randn(n, H, generator=g).to(dev, dtype)
    # Rows past vocab are garbage on purpose: padding must never reach a result.
    weight = (torch.randn(4096, H, generator=g) * 0.5).to(dev, dtype)
    target = torch.randint(0, vocab, (n,), generator=g).to(dev)
    for i in ignored:
        target[i] = -100
    return hidden, weight, target


def _shard(weight, vocab, tp, rank, multiple):
    start, end = vocab_shard_ranges(vocab, tp, multiple=multiple)[rank]
    return weight[start:end].detach().clone()


def _run(fn, hidden, w_local, target, **kw):
    """(output, grad hidden, grad local weight) with a random upstream gradient."""
    h = hidden.detach().clone().requires_grad_(True)
    w = w_local.detach().clone().requires_grad_(True)
    out = fn(h, w, target, **kw)
    g = torch.Generator().manual_seed(5)
    up = torch.rand(out.shape, generator=g).to(out.device) + 0.5
    out.backward(up)
    return out.detach(), h.grad, w.grad


def _oracle(kind, hidden, weight, target, vocab, **kw):
    def fn(h, w, t):
        logits = F.linear(h.float(), w.float())[:, :vocab]
        if kind == "ce":
            return F.cross_entropy(logits, t, **kw)
        return torch.log_softmax(logits / kw["temperature"], -1).gather(1, t[:, None])[:, 0]

    return _run(fn, hidden, weight[:vocab], target)


def _close(ours, ref, rows, start, tol):
    out, gh, gw = ours
    r_out, r_gh, r_gw = ref
    torch.testing.assert_close(out, r_out.to(out.dtype), **tol)
    torch.testing.assert_close(gh.float(), r_gh.float(), **tol)
    valid = max(0, min(rows, r_gw.shape[0] - start))
    torch.testing.assert_close(gw[:valid].float(), r_gw[start : start + valid].float(), **tol)
    assert torch.all(gw[valid:] == 0), "padding rows of the weight got a gradient"


# fp32: chunked online log-sum-exp vs one-pass torch only reorders fp32 sums of O(100)
# terms: ~1e-6 relative; 2e-5 leaves headroom and still catches any wrong term (>1e-3).
FP32 = dict(rtol=2e-5, atol=2e-5)
# bf16: our logits come out of a bf16 matmul (rounded to 8 mantissa bits, 0.4 % of
# |z| <= ~6 here) while the oracle computes them in fp32; gradients are returned in bf16.
BF16 = dict(rtol=3e-2, atol=5e-2)


def _sweep(tps, vocabs, dtype, tol, reductions=("mean", "sum", "none")):
    checked = 0
    for tp in tps:
        inside, group, rank = tp_member(tp)
        for vocab in vocabs:
            hidden, weight, target = _data(100, vocab, dtype)
            for invariant in (False, True):
                multiple = 256 if invariant else 1
                w_local = _shard(weight, vocab, tp, max(rank, 0), multiple)
                start = max(rank, 0) * w_local.shape[0]
                for red in reductions:
                    kw = dict(ignore_index=-100, label_smoothing=0.1, reduction=red)
                    ref = _oracle("ce", hidden, weight, target, vocab, **kw)
                    if not inside:
                        continue
                    ours = _run(
                        fused_linear_cross_entropy,
                        hidden,
                        w_local,
                        target,
                        tp_group=group,
                        vocab_size=vocab,
                        chunk_size=37,
                        invariant=invariant,
                        **kw,
                    )
                    _close(ours, ref, w_local.shape[0], start, tol)
                    checked += 1
                t = target.clamp(min=0)
                ref = _oracle("lp", hidden, weight, t, vocab, temperature=0.7)
                if inside:
                    ours = _run(
                        fused_linear_logprobs,
                        hidden,
                        w_local,
                        t,
                        tp_group=group,
                        vocab_size=vocab,
                        temperature=0.7,
                        chunk_size=37,
                        invariant=invariant,
                    )
                    _close(ours, ref, w_local.shape[0], start, tol)
                    checked += 1
    return checked


@world.case
def test_fused_matches_full_vocab_oracle_fp32():
    # 1000 splits evenly at TP 1, 2, 4, 8 (no padding); 997 is padded at every TP.
    assert _sweep((1, 2, 3, 4, 8), (1000, 997), torch.float32, FP32) > 0


@world.case
def test_fused_matches_full_vocab_oracle_bf16():
    assert _sweep((1, 2, 4), (997,), torch.bfloat16, BF16, reductions=("mean", "none")) > 0


@world.case
def test_fused_matches_materialized_vocab_parallel_ops():
    from mp_bridge.layers import vocab_parallel_cross_entropy, vocab_parallel_logprobs

    vocab = 997
    hidden, weight, target = _data(100, vocab)
    for tp in (1, 2, 3, 4, 8):
        inside, group, rank = tp_member(tp)
        if not inside:
            continue
        w_local = _shard(weight, vocab, tp, rank, 1)
        for invariant in (False, True):

            def materialized(h, w, t, invariant=invariant, group=group):
                logits = F.linear(copy_to_group(h, group), w)  # f: grad of h all-reduced
                loss = vocab_parallel_cross_entropy(
                    logits,
                    t,
                    tp_group=group,
                    vocab_size=vocab,
                    label_smoothing=0.2,
                    invariant=invariant,
                )
                return loss.sum() / (t != -100).sum()

            def materialized_lp(h, w, t, invariant=invariant, group=group):
                logits = F.linear(copy_to_group(h, group), w)
                return vocab_parallel_logprobs(
                    logits,
                    t,
                    tp_group=group,
                    vocab_size=vocab,
                    temperature=1.3,
                    invariant=invariant,
                )

            if invariant:
                w_local = _shard(weight, vocab, tp, rank, 256)
            kw = dict(tp_group=group, vocab_size=vocab, invariant=invariant, chunk_size=64)
            ref = _run(materialized, hidden, w_local, target)
            ours = _run(
                fused_linear_cross_entropy, hidden, w_local, target, label_smoothing=0.2, **kw
            )
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, **FP32)
            t = target.clamp(min=0)
            ref = _run(materialized_lp, hidden, w_local, t)
            ours = _run(fused_linear_logprobs, hidden, w_local, t, temperature=1.3, **kw)
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, **FP32)


def _bitwise_results(tp, vocab, n_extra, chunk, front, fn_kind):
    """Invariant results for the 150 base tokens, with ``n_extra`` unrelated tokens added."""
    hidden, weight, target = _data(150, vocab, seed=3)
    extra_h, _, extra_t = _data(max(n_extra, 1), vocab, seed=9, ignored=())
    extra_h, extra_t = extra_h[:n_extra], extra_t[:n_extra]
    if fn_kind == "ce_sum":
        extra_t = torch.full_like(extra_t, -100)  # ignored: the weight gradient is comparable
    parts = (
        [(extra_h, extra_t), (hidden, target)] if front else [(hidden, target), (extra_h, extra_t)]
    )
    h = torch.cat([p[0] for p in parts])
    t = torch.cat([p[1] for p in parts])
    base = slice(n_extra, n_extra + 150) if front else slice(0, 150)
    inside, group, rank = tp_member(tp)
    if not inside:
        return None
    w_local = _shard(weight, vocab, tp, rank, 256)
    kw = dict(tp_group=group, vocab_size=vocab, chunk_size=chunk, invariant=True)
    hh = h.detach().clone().requires_grad_(True)
    ww = w_local.clone().requires_grad_(True)
    if fn_kind == "lp":
        out = fused_linear_logprobs(hh, ww, t.clamp(min=0), temperature=0.9, **kw)
        out.backward(_upstream(out.shape[0], base))
        value = out.detach()[base]
    elif fn_kind == "ce_none":
        out = fused_linear_cross_entropy(hh, ww, t, label_smoothing=0.1, reduction="none", **kw)
        out.backward(_upstream(out.shape[0], base))
        value = out.detach()[base]
    else:
        out = fused_linear_cross_entropy(hh, ww, t, label_smoothing=0.1, reduction="sum", **kw)
        out.backward()
        value = out.detach()
    return value, hh.grad[base], ww.grad, rank * w_local.shape[0]


def _upstream(n, base):
    """Upstream grads: fixed values on the base tokens wherever they sit, 0 elsewhere
    (so the extra tokens' weight-gradient contribution is exactly zero)."""
    up = torch.zeros(n, device=current_device())
    up[base] = torch.linspace(0.5, 1.5, base.stop - base.start, device=up.device)
    return up


@world.case
def test_invariant_mode_is_bitwise_identical_across_tp_chunks_and_batches():
    vocab = 2500  # 10 blocks: at TP 4 and 8 shards hold 3 and 2 blocks (several subtrees)
    compared = 0
    for kind in ("lp", "ce_none", "ce_sum"):
        ref = _bitwise_results(1, vocab, 0, 150, False, kind)
        for tp in (1, 2, 3, 4, 8):  # 3 too: any block-aligned shard is covered
            for chunk, n_extra, front in (
                (1, 0, False),
                (100, 0, False),
                (150, 0, False),
                (64, 70, False),
                (150, 70, True),
            ):
                if kind == "ce_sum" and front:
                    continue  # a different token order changes the fp32 sum of the loss
                got = _bitwise_results(tp, vocab, n_extra, chunk, front, kind)
                if got is None:
                    continue
                value, gh, gw, start = got
                assert torch.equal(value, ref[0]), (kind, tp, chunk, n_extra)
                assert torch.equal(gh, ref[1]), (kind, tp, chunk, n_extra)
                rows = min(gw.shape[0], vocab - start)
                # Weight grad: this rank's rows of the TP = 1 grad ("gathered"). Tokens moved
                # to other tiles (front) regroup its fp32 sum over tokens, so only in place.
                if rows > 0 and not front:
                    assert torch.equal(gw[:rows], ref[2][start : start + rows]), (kind, tp)
                compared += 1
    assert compared > 0


@world.case
def test_collective_count_and_bytes_per_call():
    vocab, n = 1000, 100
    hidden, weight, target = _data(n, vocab)
    inside, group, rank = tp_member(4)
    w_local = _shard(weight, vocab, 4, rank, 256).requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    # default, chunk 40: k = 3 chunks; grads in forward for "mean".
    with CollectiveCounter() as fwd:
        loss = fused_linear_cross_entropy(h, w_local, target, tp_group=group, chunk_size=40)
    with CollectiveCounter() as bwd:
        loss.backward()
    assert fwd.counts() == {"all_gather": 3, "all_reduce": 3} and bwd.counts() == {}
    stats_bytes = 3 * sum(4 * c * 4 for c in (40, 40, 20))  # [4, C] fp32 from 3 peers
    assert fwd.bytes_received("all_gather") == stats_bytes
    assert fwd.bytes_received("all_reduce") == 100 * H * 4
    # "none": stats in forward, d hidden all-reduced chunk by chunk in backward.
    with CollectiveCounter() as fwd:
        out = fused_linear_cross_entropy(
            h, w_local, target, tp_group=group, chunk_size=40, reduction="none"
        )
    with CollectiveCounter() as bwd:
        out.sum().backward()
    assert fwd.counts() == {"all_gather": 3} and bwd.counts() == {"all_reduce": 3}
    # invariant: chunk 40 -> rounded up to whole token tiles; each rank holds one block = one
    # subtree (P = 1); per chunk one stats and one d-hidden all-gather of whole tiles.
    with CollectiveCounter() as fwd:
        loss = fused_linear_cross_entropy(
            h, w_local, target, tp_group=group, chunk_size=40, invariant=True
        )
    chunk = -(-40 // TOKEN_TILE) * TOKEN_TILE
    chunks = [min(chunk, n - s) for s in range(0, n, chunk)]
    rows = sum(-(-c // TOKEN_TILE) * TOKEN_TILE for c in chunks)  # padded to whole tiles
    assert fwd.counts() == {"all_gather": 2 * len(chunks)}
    assert fwd.bytes_received("all_gather") == 3 * rows * 4 * 4 + 3 * rows * H * 4
    with torch.no_grad(), CollectiveCounter() as fwd:
        fused_linear_cross_entropy(hidden, w_local, target, tp_group=group, chunk_size=40)
    assert fwd.counts() == {"all_gather": 3}


@world.case
def test_mean_over_only_ignored_tokens_is_nan_with_zero_grads_at_tp4():
    # F.cross_entropy(reduction="mean") over only ignored tokens: nan value, zero grads.
    inside, group, rank = tp_member(4)
    hidden, weight, target = _data(50, 1000)
    ignored = torch.full_like(target, -100).int()  # int32 ids are accepted too
    for invariant in (False, True):
        w_local = _shard(weight, 1000, 4, rank, 256 if invariant else 1)
        out, gh, gw = _run(
            fused_linear_cross_entropy,
            hidden,
            w_local,
            ignored,
            tp_group=group,
            chunk_size=16,
            label_smoothing=0.1,
            invariant=invariant,
        )
        assert torch.isnan(out), invariant
        assert torch.all(gh == 0) and torch.all(gw == 0), invariant


@world.case
def test_bad_input_raises_before_any_collective():
    vocab = 1000
    hidden, weight, target = _data(10, vocab)
    inside, group, rank = tp_member(2)
    w_local = _shard(weight, vocab, 2, rank, 1)
    bad_target = target.clone()
    bad_target[0] = 1000
    with CollectiveCounter() as counter:
        with pytest.raises(
            ValueError, match=r"vocab_shard_ranges\(vocab_size, tp_size, multiple=256\)"
        ):
            fused_linear_cross_entropy(hidden, w_local, target, tp_group=group, invariant=True)
        with pytest.raises(ValueError, match=r"reduction='avg' must be one of"):
            fused_linear_cross_entropy(hidden, w_local, target, tp_group=group, reduction="avg")
        with pytest.raises(ValueError, match=r"hidden \(10, 16\) and weight \(500, 8\)"):
            fused_linear_cross_entropy(hidden, w_local[:, :8], target, tp_group=group)
        with pytest.raises(ValueError, match=r"target holds id 1000 outside \[0, 1000\)"):
            fused_linear_cross_entropy(hidden, w_local, bad_target, tp_group=group)
        with pytest.raises(ValueError, match=r"vocab_size=1001 must be in \[1, 1000\]"):
            fused_linear_logprobs(
                hidden, w_local, target.clamp(min=0), tp_group=group, vocab_size=1001
            )
        with pytest.raises(ValueError, match=r"chunk_size=0 must be an int >= 1; or None"):
            fused_linear_logprobs(
                hidden, w_local, target.clamp(min=0), tp_group=group, chunk_size=0
            )
        with pytest.raises(TypeError, match=r"must share dtype"):
            fused_linear_logprobs(hidden, w_local.double(), target.clamp(min=0), tp_group=group)
    assert counter.counts() == {}


# Fused path gradients sum over 37 tokens / the TP ranks in fp32: atol = rtol = 1e-5.
@world.case(world_size=6)
def test_fused_losses_tp5_tp6_against_torch():
    for tp in (5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        for vocab in (7, 1001):
            gen, dev = torch.Generator().manual_seed(vocab * 3 + tp), current_device()
            weight = (torch.randn(vocab, 8, generator=gen) / 3).to(dev)
            hidden = torch.randn(37, 8, generator=gen).to(dev)
            target = torch.randint(0, vocab, (37,), generator=gen).to(dev)
            target[3] = -100
            for red in ("mean", "none"):
                w = vocab_cut(weight, vocab_shard_size(vocab, tp), rank, 0).requires_grad_()
                h = hidden.clone().requires_grad_()
                got = fused_linear_cross_entropy(
                    h, w, target, tp_group=group, vocab_size=vocab, label_smoothing=0.1,
                    reduction=red, chunk_size=5,
                )  # fmt: skip
                w_ref, h_ref = weight.clone().requires_grad_(), hidden.clone().requires_grad_()
                want = F.cross_entropy(
                    F.linear(h_ref, w_ref), target, label_smoothing=0.1, reduction=red
                )
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                got.sum().backward()
                want.sum().backward()
                torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)
                grad_w = gather_rows(w.grad, group, tp)[:vocab]
                torch.testing.assert_close(grad_w, w_ref.grad, atol=1e-5, rtol=1e-5)
