"""RL-head options on 8 ranks: fp64 oracle at TP 1, 2, 3, 4, 8 in all four paths, and
the invariant paths bitwise identical across TP, chunk sizes and batch composition.

One full weight / hidden / target set (same seed on every rank, V = 2500: 10 blocks of
256, the last one 196 true ids; weight rows past it are garbage on purpose) is split with
``vocab_shard_ranges(V, tp, multiple=256)``; TP 3 runs on ranks 0-5. The oracle is
``tests/loss_refs.py`` (plain torch in fp64) on the full tensors in one process.
"""

from __future__ import annotations

import torch

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
)
from mp_bridge.testing import DistributedWorld, current_device
from tests.loss_refs import Checks, fp64_oracle, reference
from tests.oracles import gather_rows, tp_member

world = DistributedWorld(8, timeout_s=180)
V, H, N = 2500, 16, 100
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv")
LP = [
    {"temperature": 0.8},
    {"softcap": 3.0},
    {"ignore_index": -100},
    {"return_entropy": True},
    {"temperature": 0.8, "softcap": 3.0, "ignore_index": -100, "return_entropy": True},
]
CE = [
    {"temperature": 1.3},
    {"softcap": 3.0},
    {"z_loss_weight": 1e-3, "return_z_loss": True},
    {"label_smoothing": 0.1, "temperature": 1.3, "softcap": 3.0, "z_loss_weight": 1e-3},
]
CASES = [("lp", o) for o in LP] + [("ce", o) for o in CE]
# fp32 vs fp64 on the same inputs: reordered fp32 sums of <= 2500 terms, ~1e-6 relative.
TOL = dict(rtol=2e-5, atol=2e-5)


def _data(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = current_device()
    hidden = torch.randn(n, H, generator=g).to(dev)
    weight = (torch.randn(4096, H, generator=g) * 0.8).to(dev)
    target = torch.randint(0, V, (n,), generator=g).to(dev)
    target[[2, 5]] = -100
    return hidden, weight, target


def _targets(kind, opts, target):
    return target if kind == "ce" or "ignore_index" in opts else target.clamp(min=0)


def _run(path, kind, opts, hidden, weight, target, tp, ups=None, chunk=29):
    """``(outputs, grads)`` on this rank (grads gathered to the full vocab), or ``None``
    outside the TP group."""
    inside, group, rank = tp_member(tp)
    if not inside:
        return None
    start, end = vocab_shard_ranges(V, tp, multiple=256)[rank]
    inv = path.endswith("_inv")
    t = _targets(kind, opts, target)
    if path.startswith("materialized"):
        x = (hidden @ weight[start:end].t()).requires_grad_()
        leaves = [x]
        fn = vocab_parallel_cross_entropy if kind == "ce" else vocab_parallel_logprobs
        out = fn(x, t, tp_group=group, vocab_size=V, invariant=inv, **opts)
    else:
        leaves = [hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()]
        kw = dict(tp_group=group, vocab_size=V, invariant=inv, chunk_size=chunk, **opts)
        if kind == "ce":
            out = fused_linear_cross_entropy(*leaves, t, reduction="none", **kw)
        else:
            out = fused_linear_logprobs(*leaves, t, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    if ups is None:
        ups = [torch.linspace(0.5, 1.5, t.numel(), device=t.device) * (i + 1) for i in range(2)]
    sum((o * u).sum() for o, u in zip(outs, ups) if o.requires_grad).backward()
    if path.startswith("materialized"):
        grads = [gather_rows(x.grad.t().contiguous(), group, tp).t()[:, :V]]
    else:
        grads = [leaves[0].grad, gather_rows(leaves[1].grad, group, tp)[:V]]
    return [o.detach() for o in outs], grads


def _oracle(path, kind, opts, hidden, weight, target):
    keys = ("temperature", "softcap", "z_loss_weight", "label_smoothing")
    ref_opts = {k: opts[k] for k in keys if k in opts}
    ref_opts["ignore_index"] = -100 if kind == "ce" else opts.get("ignore_index")
    t = _targets(kind, opts, target)

    def outputs(z):
        value, entropy, z_loss = reference(
            z, t, kind="ce" if kind == "ce" else "logprob", **ref_opts
        )
        outs = [value]
        outs += [entropy] if opts.get("return_entropy") else []
        outs += [z_loss.detach()] if opts.get("return_z_loss") else []
        return outs

    def ups(outs):
        return [
            torch.linspace(0.5, 1.5, N, device=hidden.device).double() * (i + 1) for i in range(2)
        ]

    return fp64_oracle(path.startswith("materialized"), hidden, weight, V, outputs, ups)


def _same(checks, got, base, what, count=None):
    for i, (a, b) in enumerate(zip(got[0] + got[1], base[0] + base[1])):
        rows = slice(None) if count is None or (i == len(got[0]) + 1) else slice(0, count)
        checks.equal(a[rows], b[rows], f"{what} tensor {i}")


@world.parametrize("kind, opts", CASES, ids=[f"{k}-{'-'.join(sorted(o))}" for k, o in CASES])
def test_option_fp64_and_bitwise_across_tp_chunks_batches(kind, opts):
    hidden, weight, target = _data()
    checks = Checks()
    for path in PATHS:
        ref = _oracle(path, kind, opts, hidden, weight, target)
        base = None
        for tp in (1, 2, 3, 4, 8):
            got = _run(path, kind, opts, hidden, weight, target, tp)
            if got is None:
                continue
            for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1], strict=True)):
                checks.close(a, b, f"{path} tp={tp} tensor {i} vs fp64", **TOL)
            if path.endswith("_inv"):
                base = got if tp == 1 else base
                _same(checks, got, base, f"{path} tp={tp} vs tp=1")
    # Chunk sizes (rounded up to whole 64-token tiles) and batch composition, at TP 4.
    base = _run("fused_inv", kind, opts, hidden, weight, target, 1)
    for chunk in (1, 100, None):
        got = _run("fused_inv", kind, opts, hidden, weight, target, 4, chunk=chunk)
        _same(checks, got, base, f"fused_inv tp=4 chunk={chunk} vs tp=1 chunk=29")
    extra_h, _, extra_t = _data(37, seed=9)
    more = (torch.cat([hidden, extra_h]), torch.cat([target, extra_t]))
    ups = [torch.linspace(0.5, 1.5, N, device=hidden.device) * (i + 1) for i in range(2)]
    ups = [torch.cat([u, u.new_zeros(37)]) for u in ups]  # extra tokens: zero upstream
    for path in ("materialized_inv", "fused_inv"):
        base = _run(path, kind, opts, hidden, weight, target, 1)
        got = _run(path, kind, opts, more[0], weight, more[1], 2, ups=ups)
        # Values and d hidden / d logits per token; d weight sums tokens in tile order and
        # the appended tokens add exact zeros.
        _same(checks, got, base, f"{path} tp=2 with 37 more tokens", count=N)
    checks.done()
