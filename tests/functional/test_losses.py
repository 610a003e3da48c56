"""Vocab-parallel cross-entropy / log-probs / entropy against full-vocab torch references.

One 8-rank world; TP groups of size 1 (``None``), 2, 3, 4 and 8 are carved out of it
(with TP=3, ranks 6 and 7 sit the case out). Every rank builds the same full logits
``[B, S, V_padded]`` from one seed, keeps its TP shard, and compares with
``F.cross_entropy`` / ``log_softmax`` on the full tensor computed in the same process.

Tolerances (the reference is torch in fp64 on the same values, then rounded to fp32;
torch's own fp32 result is ~10x further from exact than ours at vocab 50257). fp32:
per-token values are sums of up to 50k exp terms done per shard then across ranks, a few
fp32 ulps of |value| <~ 20: atol = rtol = 1e-5 (measured max 1.9e-6). Gradients are
g * (softmax - target terms) with |g| <~ 3 and a 1/T factor: atol 1e-6, rtol 1e-5
(measured max 2.1e-6 at T=0.7). bf16 inputs: values accumulate in fp32 from the same
bf16 values, so the fp32 tolerance holds (measured 1.9e-6); gradients are rounded to bf16
at the end, so they may differ by one bf16 ulp (relative 2**-7; measured max 7.2e-3 on
entries of magnitude up to ~2); fp16 likewise with its 2**-11 roundoff (rtol 2**-10).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.layers import (
    VocabParallelLMHead,
    padded_vocab_size,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
    vocab_shard_size,
)
from mp_bridge.testing import CollectiveCounter, DistributedWorld, current_device
from tests.oracles import gather_rows, rank_in, tp_group, vocab_cut

world = DistributedWorld(8)

TP_SIZES = (1, 2, 3, 4, 8)
VOCABS = ((1000, 1), (1001, 1), (50257, 128))  # (vocab_size, multiple)
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
FP32_GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
BF16_GRAD_TOL = dict(atol=1e-8, rtol=2**-7)
# fp16: the same single rounding of the fp32 gradient, with a 2**-11 unit roundoff.
GRAD_TOL = {
    torch.float32: FP32_GRAD_TOL,
    torch.bfloat16: BF16_GRAD_TOL,
    torch.float16: dict(atol=1e-7, rtol=2**-10),
}


def full_problem(vocab: int, multiple: int, tp: int, dtype: torch.dtype, seed: int = 0):
    """Full padded logits, targets with some ignored, upstream grad; same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    padded = padded_vocab_size(vocab, tp, multiple=multiple)
    logits = (3 * torch.randn(2, 3, padded, generator=gen)).to(dtype)
    target = torch.randint(0, vocab, (2, 3), generator=gen)
    target[0, 1] = vocab - 1  # the last real id sits next to the padding
    target[1, 2] = -100
    grad = torch.randn(2, 3, generator=gen)
    dev = current_device()
    return logits.to(dev), target.to(dev), grad.to(dev)


def shard(full: torch.Tensor, vocab: int, multiple: int, tp: int, group) -> torch.Tensor:
    start, end = vocab_shard_ranges(vocab, tp, multiple=multiple)[rank_in(group)]
    return full[..., start:end].clone().requires_grad_()


def reference(fn, full: torch.Tensor, vocab: int, upstream: torch.Tensor):
    """fp32 value and gradient of ``fn(full[..., :vocab])`` computed in fp64 by torch.

    fp64, not fp32: torch's own fp32 result is ~10x further from the exact answer than
    ours at vocab 50257 (it would dominate the comparison). Padding columns get 0 grad.
    """
    leaf = full.detach().double().requires_grad_()
    out = fn(leaf[..., :vocab])
    (grad,) = torch.autograd.grad(out, leaf, upstream.double())
    return out.detach().float(), grad.float()


def check_op(
    name: str,
    ours_fn,
    ref_fn,
    dtype: torch.dtype,
    *,
    with_ignore: bool = True,
    target_dtype: torch.dtype = torch.long,
):
    """Run one op over every TP size and vocab; return the max errors seen.

    Mismatches are collected and raised at the end, so a failing rank still issues the
    same collectives as the others (an early raise would leave them hanging).
    """
    worst = {"value": 0.0, "grad": 0.0}
    failures: list[str] = []
    for tp in TP_SIZES:
        group, active = tp_group(tp)
        if not active:
            continue
        for vocab, multiple in VOCABS:
            full, target, upstream = full_problem(vocab, multiple, tp, dtype, seed=tp * 7 + vocab)
            if not with_ignore:
                target = target.clamp(min=0)
            ref_val, ref_grad = reference(lambda z, t=target: ref_fn(z, t), full, vocab, upstream)
            local = shard(full, vocab, multiple, tp, group)
            before = local.detach().clone()
            with CollectiveCounter() as fwd:
                val = ours_fn(local, target.to(target_dtype), group, vocab)
            with CollectiveCounter() as bwd:
                (grad,) = torch.autograd.grad(val, local, upstream)
            start, end = vocab_shard_ranges(vocab, tp, multiple=multiple)[rank_in(group)]
            ref_local = ref_grad[..., start:end]
            where = f"{name} tp={tp} vocab={vocab} dtype={dtype}"
            tol = GRAD_TOL[dtype]
            checks = [
                (fwd.counts() == ({"all_reduce": 2} if tp > 1 else {}), f"fwd {fwd.counts()}"),
                (bwd.counts() == {}, f"backward issued {bwd.counts()}"),
                (torch.equal(local.detach(), before), "input logits were modified"),
                (val.dtype == torch.float32 and grad.dtype == dtype, "dtypes"),
                (torch.allclose(val, ref_val, **FP32_TOL), "values"),
                (torch.allclose(grad, ref_local.to(dtype), **tol), "grads"),
            ]
            failures += [f"{where}: {what}" for ok, what in checks if not ok]
            worst["value"] = max(worst["value"], (val - ref_val).abs().max().item())
            worst["grad"] = max(worst["grad"], (grad.float() - ref_local).abs().max().item())
    assert not failures, f"{failures} (max errors {worst})"
    return worst


def _ce(eps):
    ours = lambda z, t, g, v: vocab_parallel_cross_entropy(
        z, t, tp_group=g, vocab_size=v, label_smoothing=eps
    )
    ref = lambda z, t: F.cross_entropy(
        z.flatten(0, -2), t.flatten(), label_smoothing=eps, reduction="none"
    ).view(t.shape)
    return ours, ref


@world.case
def test_cross_entropy_fp32():
    return check_op("ce", *_ce(0.0), torch.float32)


@world.case
def test_cross_entropy_label_smoothing_fp32():
    return check_op("ce_smooth", *_ce(0.1), torch.float32)


@world.case
def test_cross_entropy_bf16():
    return check_op("ce_bf16", *_ce(0.1), torch.bfloat16)


@world.case
def test_cross_entropy_fp16_with_int32_targets():
    # Token ids often arrive as int32: accepted, and the same loss as int64 ids.
    return check_op("ce_fp16", *_ce(0.1), torch.float16, target_dtype=torch.int32)


def _logprobs(temperature):
    ours = lambda z, t, g, v: vocab_parallel_logprobs(
        z, t, tp_group=g, vocab_size=v, temperature=temperature
    )
    ref = lambda z, t: torch.log_softmax(z / temperature, -1).gather(-1, t[..., None])[..., 0]
    return ours, ref


@world.case
def test_logprobs_fp32_with_temperature():
    return check_op("logprobs", *_logprobs(0.7), torch.float32, with_ignore=False)


@world.case
def test_logprobs_bf16():
    return check_op("logprobs_bf16", *_logprobs(1.0), torch.bfloat16, with_ignore=False)


def _entropy():
    ours = lambda z, t, g, v: vocab_parallel_entropy(z, tp_group=g, vocab_size=v)

    def ref(z, t):
        logp = torch.log_softmax(z, -1)
        return -(logp.exp() * logp).sum(-1)

    return ours, ref


@world.case
def test_entropy_fp32():
    return check_op("entropy", *_entropy(), torch.float32)


@world.case
def test_entropy_bf16():
    return check_op("entropy_bf16", *_entropy(), torch.bfloat16)


@world.case
def test_ignored_tokens_have_zero_loss_and_grad():
    group, _ = tp_group(8)
    full, target, _ = full_problem(1001, 1, 8, torch.float32)
    target[0] = 7  # ignore_index may be a real id: it still wins
    target[1] = torch.tensor([3, 1000, 520], device=target.device)
    local = shard(full, 1001, 1, 8, group)
    loss = vocab_parallel_cross_entropy(local, target, tp_group=group, ignore_index=7)
    assert torch.all(loss[0] == 0) and torch.all(loss[1] > 0)
    (grad,) = torch.autograd.grad(loss.sum(), local)
    assert torch.all(grad[0] == 0) and grad[1].abs().sum() > 0


@world.case
def test_padding_invariance_tp1_vs_tp8():
    # The same LM (vocab 1001, zero padding rows) unpadded at TP=1 and padded to 1024 at
    # TP=8: padding rows give logit 0, which would shift the loss unless masked out.
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = 1001, 16
    weight = torch.randn(vocab, hidden, generator=gen).to(current_device())
    h = torch.randn(2, 4, hidden, generator=gen).to(current_device())
    target = torch.randint(0, vocab, (2, 4), generator=gen).to(current_device())
    group, _ = tp_group(8)
    losses = []
    for g, multiple in ((None, 1), (group, 64)):
        head = VocabParallelLMHead.from_full(weight, tp_group=g, multiple=multiple)
        logits = head(h)
        losses.append(vocab_parallel_cross_entropy(logits, target, tp_group=g, vocab_size=vocab))
    assert head.weight.shape[0] * 8 == 1024  # TP=8 really is padded
    torch.testing.assert_close(losses[0], losses[1], **FP32_TOL)
    ref = F.cross_entropy((h @ weight.T).flatten(0, 1), target.flatten(), reduction="none")
    torch.testing.assert_close(losses[1], ref.view(2, 4), **FP32_TOL)


@world.case
def test_parity_with_megatron_cross_entropy_math():
    # megatron-core's _VocabParallelCrossEntropy reads the global TP group, so replay its
    # static math with the two all-reduces on our group; exact same semantics when the
    # vocab divides TP, without smoothing or ignored tokens.
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as M

    for tp in (2, 4, 8):
        group, active = tp_group(tp)
        if not active:
            continue
        full, target, upstream = full_problem(1000, 1, tp, torch.float32, seed=tp)
        target = target.clamp(min=0)
        local = shard(full, 1000, 1, tp, group)
        ours = vocab_parallel_cross_entropy(local, target, tp_group=group)
        (our_grad,) = torch.autograd.grad(ours, local, upstream)

        z, m = M.calculate_logits_max(local.detach().clone())
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        start, end = vocab_shard_ranges(1000, tp)[dist.get_rank(group)]
        mask, tgt1d, pred, sumexp, exp = M.calculate_predicted_logits(z, target, m, start, end)
        dist.all_reduce(pred, group=group)
        dist.all_reduce(sumexp, group=group)
        softmax, loss = M.calculate_cross_entropy_loss(exp, pred, sumexp)
        ops = M.prepare_gradient_calculation_operands(softmax, mask)
        grad = M.calculate_gradients(*ops[:2], tgt1d, *ops[2:], upstream)
        torch.testing.assert_close(ours, loss, **FP32_TOL)
        torch.testing.assert_close(our_grad, grad, **FP32_GRAD_TOL)


# TP sizes that do not divide 8 and leave a rank out (TP 5 on 6 ranks). Tolerances: values
# against fp64 torch atol = rtol = 1e-5 (a few fp32 ulps of values <~ 20); logit gradients
# (softmax - onehot terms, |g| <= ~3) atol 1e-6, rtol 1e-5.
@world.case(world_size=6)
def test_materialized_ops_tp5_tp6_against_torch():
    for tp in (5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        for vocab in (7, 4099):
            gen, dev = torch.Generator().manual_seed(vocab + tp), current_device()
            full = (3 * torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64)).to(dev)
            target = torch.randint(0, vocab, (3, 5), generator=gen).to(dev)
            target[0, 0], target[1, 1] = vocab - 1, 3
            up = torch.randn(3, 5, generator=gen, dtype=torch.float64).to(dev)
            local = vocab_cut(full.float(), vocab_shard_size(vocab, tp), rank, -1).requires_grad_()
            ref = full.clone().requires_grad_()
            ce = vocab_parallel_cross_entropy(
                local, target, tp_group=group, vocab_size=vocab, ignore_index=3,
                label_smoothing=0.2,
            )  # fmt: skip
            want = F.cross_entropy(
                ref.flatten(0, 1), target.flatten(), ignore_index=3, label_smoothing=0.2,
                reduction="none",
            ).view(3, 5)  # fmt: skip
            lp = vocab_parallel_logprobs(
                local, target, tp_group=group, vocab_size=vocab, temperature=0.7
            )
            want_lp = torch.log_softmax(ref / 0.7, -1).gather(-1, target[..., None])[..., 0]
            ent = vocab_parallel_entropy(local, tp_group=group, vocab_size=vocab)
            want_ent = -(torch.softmax(ref, -1) * torch.log_softmax(ref, -1)).sum(-1)
            for got, exp in ((ce, want), (lp, want_lp), (ent, want_ent)):
                torch.testing.assert_close(got.double(), exp.detach(), atol=1e-5, rtol=1e-5)
            ((ce + lp + ent).double() * up).sum().backward()
            ((want + want_lp + want_ent) * up).sum().backward()
            grad = gather_rows(local.grad.movedim(-1, 0), group, tp)[:vocab].movedim(0, -1)
            torch.testing.assert_close(grad.double(), ref.grad, atol=1e-6, rtol=1e-5)
