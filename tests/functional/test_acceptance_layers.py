"""Acceptance probes on a 6-rank world: TP sizes the rest of the suite does not run (5, 6).

TP groups of consecutive ranks (``_vocab_tp_groups``; with TP = 5 rank 5 sits out). Every
rank builds the same full problem from one seed and compares with torch in one process.

Tolerances: values are fp32 sums of <= 4099 exp terms against an fp64 reference:
atol = rtol = 1e-5 (a few fp32 ulps of values <~ 20). Logit gradients (softmax - onehot
terms, |g| <= ~3): atol 1e-6, rtol 1e-5. Fused path gradients sum over 37 tokens / the TP
ranks in fp32: atol = rtol = 1e-5. Invariant mode: ``torch.equal`` (bitwise) between TP 1
(the unpadded full tensor) and TP 2, 3, 5, 6 on the ``multiple=256`` layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _vocab_tp_groups import rank_in, tp_group

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_shard_size,
)
from mp_bridge.testing import DistributedWorld

world = DistributedWorld(6, timeout_s=120)


def _gather_rows(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _shard(full: torch.Tensor, tp: int, rank: int, multiple: int, dim: int) -> torch.Tensor:
    """This rank's rows (dim 0) / columns (dim -1) of ``full``, zero padded."""
    vocab = full.shape[dim]
    v_local = vocab_shard_size(vocab, tp, multiple=multiple)
    start = rank * v_local
    n = max(min(vocab - start, v_local), 0)
    shape = list(full.shape)
    shape[dim] = v_local
    out = full.new_zeros(shape)
    if n > 0:  # a rank past the true vocab holds only padding
        out.narrow(dim, 0, n).copy_(full.narrow(dim, start, n))
    return out


@world.case
def test_materialized_ops_tp5_tp6_against_torch():
    for tp in (5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        for vocab in (7, 4099):
            gen = torch.Generator().manual_seed(vocab + tp)
            full = 3 * torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64)
            target = torch.randint(0, vocab, (3, 5), generator=gen)
            target[0, 0], target[1, 1] = vocab - 1, 3
            up = torch.randn(3, 5, generator=gen, dtype=torch.float64)
            local = _shard(full.float(), tp, rank, 1, -1).requires_grad_()
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
            grad = _gather_rows(local.grad.movedim(-1, 0), group, tp)[:vocab].movedim(0, -1)
            torch.testing.assert_close(grad.double(), ref.grad, atol=1e-6, rtol=1e-5)


@world.case
def test_fused_losses_tp5_tp6_against_torch():
    for tp in (5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        for vocab in (7, 1001):
            gen = torch.Generator().manual_seed(vocab * 3 + tp)
            weight = torch.randn(vocab, 8, generator=gen) / 3
            hidden = torch.randn(37, 8, generator=gen)
            target = torch.randint(0, vocab, (37,), generator=gen)
            target[3] = -100
            for red in ("mean", "none"):
                w = _shard(weight, tp, rank, 1, 0).requires_grad_()
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
                grad_w = _gather_rows(w.grad, group, tp)[:vocab]
                torch.testing.assert_close(grad_w, w_ref.grad, atol=1e-5, rtol=1e-5)


@world.case
def test_invariant_bitwise_tp1_unpadded_vs_tp2_3_5_6():
    vocab, n = 1001, 70
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(vocab, 16, generator=gen) / 4
    hidden = torch.randn(n, 16, generator=gen)
    target = torch.randint(0, vocab, (n,), generator=gen)
    padded = torch.cat([weight, weight.new_zeros(1024 - vocab, 16)])
    logits = hidden @ padded.t()  # one full logits tensor, split at every TP size
    results = {}
    for tp in (1, 2, 3, 5, 6):
        group, inside = tp_group(tp)
        if not inside:
            continue
        rank = rank_in(group)
        # TP 1: the caller's unpadded tensors; TP > 1: the multiple=256 layout.
        w0 = weight if tp == 1 else _shard(padded, tp, rank, 256, 0)
        z0 = logits[:, :vocab] if tp == 1 else _shard(logits, tp, rank, 256, -1)
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
        grad_z = _gather_rows(z.grad.t(), group, tp)[:vocab]
        results[tp] = (lp, h.grad, _gather_rows(w.grad, group, tp)[:vocab], ce, grad_z)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    merged = {tp: r for rank_results in everyone for tp, r in rank_results.items()}
    assert sorted(merged) == [1, 2, 3, 5, 6]
    for tp in (2, 3, 5, 6):
        for i, (a, b) in enumerate(zip(merged[1], merged[tp])):
            assert torch.equal(a, b), f"TP {tp} output {i} differs from TP 1"
