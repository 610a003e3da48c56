"""Per-class cross-entropy weights (``ce_weight``) on 4 ranks: both cross-entropy doors x
default / invariant at TP 1, 2 and 4 against torch's ``F.cross_entropy(weight=)`` in fp64
(values and gradients), the invariant paths bitwise identical across TP (shards of whole
256-row blocks), a weight that differs across TP ranks refused by its fingerprint and a
bad one refused on every rank before any collective.

One full weight / hidden / target set (same seed on every rank; V = 1000: 4 blocks of
256, the last one 232 true ids) is split with ``vocab_shard_ranges(V, tp, multiple=256)``;
the oracle runs on the full tensors. All cases run in one set of 4 processes.
"""

from __future__ import annotations

import torch

from mp_bridge.checks import AgreementError
from mp_bridge.layers import (
    fused_linear_cross_entropy,
    vocab_parallel_cross_entropy,
    vocab_shard_ranges,
)
from mp_bridge.testing import DistributedWorld, current_device
from tests.loss_refs import Checks, fp64_oracle, weighted_cross_entropy
from tests.oracles import gather_rows, tp_member

world = DistributedWorld(4, timeout_s=240)
V, H, B, S = 1000, 16, 4, 13
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv")
# fp32 against fp64 (tests/functional/test_loss_token_options_tp.py): ~1e-6 relative.
TOL = dict(rtol=2e-5, atol=2e-5)
CASES = {
    "smooth-mean-z": {"label_smoothing": 0.1, "reduction": "mean", "z_loss_weight": 1e-3},
    "smooth-none-T-cap": {
        "label_smoothing": 0.2,
        "reduction": "none",
        "temperature": 0.8,
        "softcap": 3.0,
    },
}


def _data():
    g = torch.Generator().manual_seed(0)
    dev = current_device()
    hidden = torch.randn(B, S, H, generator=g).to(dev)
    weight = (torch.randn(1024, H, generator=g) * 0.8).to(dev)
    target = torch.randint(0, V, (B, S), generator=g).to(dev)
    target[1, 2], target[3, :5] = -100, -100
    ce_weight = (torch.rand(V, generator=g) * 2 + 0.2).to(dev)
    ce_weight[[3, 600]] = 0.0
    return hidden, weight, target, ce_weight


def _call(path, x_or_leaves, target, ce_weight, kw):
    if path.startswith("materialized"):
        return vocab_parallel_cross_entropy(x_or_leaves[0], target, ce_weight=ce_weight, **kw)
    return fused_linear_cross_entropy(
        *x_or_leaves, target, ce_weight=ce_weight, chunk_size=23, **kw
    )


def _run(path, opts, hidden, weight, target, ce_weight, tp):
    """``(outputs, grads)`` on this rank (grads gathered to the full vocab), or ``None``
    outside the TP group."""
    inside, group, rank = tp_member(tp)
    if not inside:
        return None
    start, end = vocab_shard_ranges(V, tp, multiple=256)[rank]
    kw = dict(opts, tp_group=group, vocab_size=V, invariant=path.endswith("_inv"))
    if path.startswith("materialized"):
        leaves = [(hidden @ weight[start:end].t()).requires_grad_()]
    else:
        leaves = [hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()]
    out = _call(path, leaves, target, ce_weight, kw)
    up = torch.linspace(0.5, 1.5, max(1, out.numel()), device=out.device).view(out.shape)
    (out * up).sum().backward()
    if path.startswith("materialized"):
        grad = gather_rows(leaves[0].grad.transpose(0, -1).contiguous(), group, tp)[:V]
        grads = [grad.transpose(0, -1)]
    else:
        grads = [leaves[0].grad, gather_rows(leaves[1].grad, group, tp)[:V]]
    return [out.detach()], grads


def _oracle(path, opts, hidden, weight, target, ce_weight):
    def outputs(z):
        return [weighted_cross_entropy(z, target, ce_weight, **opts)]

    def ups(outs):
        n = max(1, outs[0].numel())
        return [torch.linspace(0.5, 1.5, n, device=hidden.device).double().view(outs[0].shape)]

    return fp64_oracle(path.startswith("materialized"), hidden, weight, V, outputs, ups)


@world.case
def test_ce_weight_fp64_at_tp_1_2_4_and_invariant_bitwise():
    hidden, weight, target, ce_weight = _data()
    checks = Checks()
    for name, opts in CASES.items():
        for path in PATHS:
            ref = _oracle(path, opts, hidden, weight, target, ce_weight)
            base = None
            for tp in (1, 2, 4):
                got = _run(path, opts, hidden, weight, target, ce_weight, tp)
                if got is None:
                    continue
                for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1], strict=True)):
                    checks.close(a, b, f"{name} {path} tp={tp} tensor {i} vs fp64", **TOL)
                if path.endswith("_inv"):
                    base = got if tp == 1 else base
                    for i, (a, b) in enumerate(zip(got[0] + got[1], base[0] + base[1])):
                        checks.equal(a, b, f"{name} {path} tp={tp} tensor {i} vs tp=1")
    checks.done()


@world.case
def test_ce_weight_that_differs_across_tp_ranks_or_is_bad_is_refused():
    hidden, weight, target, ce_weight = _data()
    _, group, rank = tp_member(4)
    start, end = vocab_shard_ranges(V, 4, multiple=256)[rank]
    shard = weight[start:end]
    off = ce_weight.clone()
    off[10] += 0.5 * (rank == 2)  # one rank's weights differ in one class
    kw = dict(tp_group=group, vocab_size=V)
    for path in PATHS:
        inv = path.endswith("_inv")
        args = [hidden @ shard.t()] if path.startswith("materialized") else [hidden, shard]
        try:
            _call(path, args, target, off, dict(kw, invariant=inv))
        except AgreementError as exc:
            assert "ce_weight (fingerprint)" in str(exc), (path, str(exc))
        else:
            raise AssertionError(f"{path}: no AgreementError")
        # the local shard's weights: refused on every rank by the parse (no collective ran,
        # so nobody hangs)
        try:
            _call(path, args, target, ce_weight[start:end], dict(kw, invariant=inv))
        except ValueError as exc:
            rows = ce_weight[start:end].shape[0]  # the last rank's rows stop at V
            assert f"ce_weight shape ({rows},) must be" in str(exc), (path, str(exc))
        else:
            raise AssertionError(f"{path}: a shard of ce_weight was accepted")
