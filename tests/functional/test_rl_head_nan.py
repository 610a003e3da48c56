"""-inf logits (vocabulary masks) on 4 ranks: finite, correct values and gradients in all
four paths (materialized / fused x default / invariant) at TP 1, 2, 4.

Per-row mask patterns in one batch (V = 1024, 4 blocks of 256; TP 2 and 4 shards are
whole blocks): a whole block ``[256, 512)``; ``[512, 1024)``, a whole TP 2 shard and two
whole TP 4 shards; every id but 300; no mask. Rows with target ``-100`` are masked
(ignored). The fused paths get the same ``-inf`` logits from the weight, one pattern for
the whole batch at a time (a weight mask is every token's): a feature of 4 in ``hidden``
times ``-3e38`` in the masked ids' weight rows overflows fp32 to ``-inf``. The oracle is
``log_softmax`` in fp64 (``tests/loss_refs.py``) on the same logits, those set to -inf.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
)
from mp_bridge.testing import DistributedWorld, current_device
from tests.loss_refs import Checks, reference
from tests.oracles import gather_rows, tp_member

world = DistributedWorld(4, timeout_s=120)
V, H, N, F = 1024, 16, 72, 13  # F free features, then 3 pattern selectors
MASKS = (range(256, 512), range(512, 1024), [i for i in range(V) if i != 300])
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv")
# fp32 vs fp64 on the same logits / inputs: reordered fp32 sums of <= 1024 terms, ~1e-6.
TOL = dict(rtol=2e-5, atol=2e-5)


def _data(shared: int | None):
    """Per-row patterns (``shared=None``) or pattern ``shared`` in every row."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.zeros(N, H)
    hidden[:, :F] = torch.randn(N, F, generator=g)
    weight = torch.zeros(V, H)
    weight[:, :F] = torch.randn(V, F, generator=g) * 0.7
    pattern = torch.arange(N) % 4 if shared is None else torch.full((N,), shared)  # 3: none
    target = torch.randint(0, 256, (N,), generator=g)  # never in a mask of rows 0-1
    for p, ids in enumerate(MASKS):
        if shared is not None and p != shared:
            continue  # a -3e38 weight column no row selects would still reach d hidden
        ids = torch.as_tensor(list(ids))
        hidden[pattern == p, F + p] = 4.0
        weight[ids, F + p] = -3e38
        weight[ids, :F] = 0.0
    target[pattern == 2] = 300  # the one finite id
    target[[5, 6, 17, 30]] = -100
    dev = current_device()
    return hidden.to(dev), weight.to(dev), target.to(dev)


def _logits64(h, w):
    z = h.double() @ w.double().t()
    return z.masked_fill(z < -1e38, float("-inf"))


def _run(path, kind, hidden, weight, target, group, tp, rank):
    """This rank's ``(outputs, grads)``; grads are full-vocab (gathered) where sharded."""
    start, end = vocab_shard_ranges(V, tp, multiple=256)[rank]
    inv = path.endswith("_inv")
    opts = {"ignore_index": -100, "return_entropy": True} if kind == "lp" else {}
    if path.startswith("materialized"):
        x = _logits64(hidden, weight).float()[:, start:end].clone().requires_grad_()
        fn = vocab_parallel_cross_entropy if kind == "ce" else vocab_parallel_logprobs
        out = fn(x, target, tp_group=group, invariant=inv, **opts)
        leaves = [x]
    else:
        leaves = [hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()]
        fn = fused_linear_cross_entropy if kind == "ce" else fused_linear_logprobs
        if kind == "ce":
            opts["reduction"] = "none"
        out = fn(*leaves, target, tp_group=group, invariant=inv, chunk_size=40, **opts)
    outs = out if isinstance(out, tuple) else (out,)
    ups = [torch.linspace(0.5, 1.5, N, device=target.device) * (i + 1) for i in range(len(outs))]
    sum((o * u).sum() for o, u in zip(outs, ups)).backward()
    grads = [leaves[0].grad]
    if path.startswith("materialized"):
        grads = [gather_rows(leaves[0].grad.t().contiguous(), group, tp).t()]
    else:
        grads.append(gather_rows(leaves[1].grad, group, tp))
    return [o.detach() for o in outs], grads


def _oracle(path, kind, hidden, weight, target):
    if path.startswith("materialized"):
        leaves = [_logits64(hidden, weight).float().double().requires_grad_()]
        z = leaves[0]
    else:
        leaves = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
        z = leaves[0] @ leaves[1].t()
        z = z.masked_fill(z.detach() < -1e38, float("-inf"))
    value, entropy, _ = reference(
        z, target, kind="ce" if kind == "ce" else "logprob", ignore_index=-100
    )
    outs = [value] if kind == "ce" else [value, entropy]
    ups = [torch.linspace(0.5, 1.5, N, device=z.device) * (i + 1) for i in range(len(outs))]
    sum((o * u.double()).sum() for o, u in zip(outs, ups)).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


@world.parametrize("path", PATHS)
def test_masked_logits_are_finite_and_match_fp64(path):
    checks = Checks()
    results = {}
    # A weight-made mask is shared by all tokens: else d hidden would sum g * -3e38 terms.
    patterns = (None,) if path.startswith("materialized") else (0, 1, 2)
    for pattern in patterns:
        hidden, weight, target = _data(pattern)
        for kind in ("ce", "lp"):
            ref = _oracle(path, kind, hidden, weight, target)
            for tp in (1, 2, 4):
                inside, group, rank = tp_member(tp)
                outs, grads = _run(path, kind, hidden, weight, target, group, tp, rank)
                for i, (a, b) in enumerate(zip(outs + grads, ref[0] + ref[1])):
                    what = f"{path} pattern={pattern} {kind} tp={tp} tensor {i}"
                    if not torch.isfinite(a).all():
                        checks.failures.append(f"{what}: not finite")
                    checks.close(a, b, what, **TOL)
                results[(pattern, kind, tp)] = outs + grads
    if path.endswith("_inv"):  # bitwise TP-invariant, values and gradients
        for (pattern, kind, tp), got in results.items():
            base = results[(pattern, kind, 1)]
            for i, (a, b) in enumerate(zip(got, base)):
                checks.equal(a, b, f"{path} pattern={pattern} {kind} tp={tp} vs tp=1 tensor {i}")
    checks.done()
    dist.barrier()
