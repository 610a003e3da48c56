"""Per-token temperature, sum_pi_squared, reduction= and the entropy's options on 4 ranks:
every loss API in every path (materialized / fused x invariant or not) against the fp64
reference of ``tests/loss_refs.py`` at TP 1, 2 and 4, the invariant paths bitwise
identical across TP, and a temperature that differs across TP ranks refused. Per-class
weights (``ce_weight``) likewise on both cross-entropy doors against torch's
``F.cross_entropy(weight=)``, with a weight that differs across ranks or is this rank's
shard refused.

One full weight / hidden / target set (same seed on every rank; V = 1000: 4 blocks of
256, the last one 232 true ids; weight rows past it are garbage on purpose) is split with
``vocab_shard_ranges(V, tp, multiple=256)``. The oracle runs on the full tensors in one
process. All cases of a world run in one set of 4 processes (``DistributedWorld``).
"""

from __future__ import annotations

import pytest
import torch

from mp_bridge.checks import AgreementError
from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
)
from mp_bridge.testing import DistributedWorld, current_device
from tests.loss_refs import Checks, fp64_oracle, reference, sum_pi_squared, weighted_cross_entropy
from tests.oracles import gather_rows, tp_member

world = DistributedWorld(4, timeout_s=240)
V, H, B, S = 1000, 16, 4, 13
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv")
# fp32 against fp64 on the same inputs: reordered fp32 sums of <= 1000 terms of size
# <= ~10 plus one fp32 rounding of 1 / T per token: ~1e-6 relative; 2e-5 still catches
# a wrong temperature, a missing soft-cap or a dropped term (all move values by > 1e-3).
TOL = dict(rtol=2e-5, atol=2e-5)


def _data():
    g = torch.Generator().manual_seed(0)
    dev = current_device()
    hidden = torch.randn(B, S, H, generator=g).to(dev)
    weight = (torch.randn(1024, H, generator=g) * 0.8).to(dev)
    target = torch.randint(0, V, (B, S), generator=g).to(dev)
    target[1, 2], target[3, :5] = -100, -100
    token_t = (torch.rand(B, S, generator=g) * 1.5 + 0.3).to(dev)
    sample_t = (torch.rand(B, 1, generator=g) * 1.5 + 0.3).to(dev)
    return hidden, weight, target, {"token": token_t, "sample": sample_t}


def _opts(name, temps):
    """The option sets: every new option, alone and mixed with the existing ones."""
    t, s = temps["token"], temps["sample"]
    return {
        "ce-token-T": ("ce", {"temperature": t, "softcap": 3.0, "label_smoothing": 0.1}),
        "ce-sample-T-mean": ("ce", {"temperature": s, "z_loss_weight": 1e-3, "reduction": "mean"}),
        "ce-sum": ("ce", {"temperature": 0.8, "reduction": "sum", "ignore_index": None}),
        "lp-token-T-all": (
            "lp",
            {
                "temperature": t,
                "softcap": 3.0,
                "return_entropy": True,
                "return_sum_pi_squared": True,
            },
        ),
        "lp-sq": ("lp", {"return_sum_pi_squared": True}),
        "lp-sample-T-mean": ("lp", {"temperature": s, "return_entropy": True, "reduction": "mean"}),
        "ent-softcap": ("ent", {"softcap": 3.0}),
        "ent-token-T-target": ("ent", {"temperature": t, "softcap": 3.0, "target": True}),
        "ent-sample-T-sum": ("ent", {"temperature": s, "target": True, "reduction": "sum"}),
    }[name]


NAMES = [
    "ce-token-T",
    "ce-sample-T-mean",
    "ce-sum",
    "lp-token-T-all",
    "lp-sq",
    "lp-sample-T-mean",
    "ent-softcap",
    "ent-token-T-target",
    "ent-sample-T-sum",
]


def _target(api, opts, target):
    """Targets with -100 only where some id is ignored (else every id must be real)."""
    ignored = opts.get("ignore_index", -100) is not None and (api != "ent" or opts.get("target"))
    return target if ignored else target.clamp(min=0)


def _ups(shape, count, device, dtype=torch.float32):
    base = torch.linspace(0.5, 1.5, max(1, shape.numel()), device=device, dtype=dtype)
    return [base.view(shape) * (i + 1) for i in range(count)]


def _run(path, api, opts, hidden, weight, target, tp, order=None):
    """``(outputs, grads)`` on this rank (grads gathered to the full vocab), or ``None``
    outside the TP group. ``order``: the tokens' permutation (applied to the upstream
    gradients, so every token keeps its own)."""
    inside, group, rank = tp_member(tp)
    if not inside:
        return None
    start, end = vocab_shard_ranges(V, tp, multiple=256)[rank]
    kw = dict(opts, tp_group=group, vocab_size=V, invariant=path.endswith("_inv"))
    target = _target(api, opts, target)
    if path.startswith("materialized"):
        x = (hidden @ weight[start:end].t()).requires_grad_()
        leaves = [x]
        if api == "ent":
            kw["target"] = target if kw.pop("target", False) else None
            out = vocab_parallel_entropy(x, **kw)
        else:
            fn = vocab_parallel_cross_entropy if api == "ce" else vocab_parallel_logprobs
            out = fn(x, target, **kw)
    else:
        leaves = [hidden.clone().requires_grad_(), weight[start:end].clone().requires_grad_()]
        kw.setdefault("reduction", "none")
        fn = fused_linear_cross_entropy if api == "ce" else fused_linear_logprobs
        out = fn(*leaves, target, chunk_size=23, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = _ups(outs[0].shape, len(outs), hidden.device)
    if order is not None:
        ups = [u.reshape(-1)[order].view(u.shape) for u in ups]
    sum((o * u).sum() for o, u in zip(outs, ups) if o.requires_grad).backward()
    if path.startswith("materialized"):
        grads = [gather_rows(x.grad.transpose(0, -1).contiguous(), group, tp)[:V]]
        grads = [grads[0].transpose(0, -1)]
    else:
        grads = [leaves[0].grad, gather_rows(leaves[1].grad, group, tp)[:V]]
    assert all(not o.requires_grad for o in outs[1 + bool(opts.get("return_entropy")) :])
    return [o.detach() for o in outs], grads


def _oracle(path, api, opts, hidden, weight, target):
    target = _target(api, opts, target)
    ignore = opts.get("ignore_index", -100) if (target < 0).any() else None
    keys = ("temperature", "softcap", "label_smoothing", "z_loss_weight")
    kw = {k: opts[k] for k in keys if k in opts}
    kind = "ce" if api == "ce" else "logprob"

    def outputs(z):
        value, entropy, _ = reference(z, target, kind=kind, ignore_index=ignore, **kw)
        outs = [entropy] if api == "ent" else [value]
        outs += [entropy] if opts.get("return_entropy") else []
        if opts.get("return_sum_pi_squared"):
            sq_kw = {k: kw[k] for k in ("temperature", "softcap") if k in kw}
            outs.append(sum_pi_squared(z, target, ignore_index=ignore, **sq_kw).detach())
        reduction = opts.get("reduction", "none")
        if reduction != "none":
            count = target.numel() if ignore is None else (target != ignore).sum()
            outs = [o.sum() / (count if reduction == "mean" else 1) for o in outs]
        return outs

    def ups(outs):
        return _ups(outs[0].shape, len(outs), hidden.device, torch.float64)

    materialized = path.startswith("materialized")
    return fp64_oracle(materialized, hidden, weight, V, outputs, ups)


@world.parametrize("name", NAMES)
def test_new_option_fp64_at_tp_1_2_4_and_invariant_bitwise(name):
    hidden, weight, target, temps = _data()
    api, opts = _opts(name, temps)
    checks = Checks()
    for path in PATHS:
        if api == "ent" and path.startswith("fused"):
            continue
        ref = _oracle(path, api, opts, hidden, weight, target)
        base = None
        for tp in (1, 2, 4):
            got = _run(path, api, opts, hidden, weight, target, tp)
            for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1], strict=True)):
                checks.close(a, b, f"{path} tp={tp} tensor {i} vs fp64", **TOL)
            if path.endswith("_inv"):
                base = got if tp == 1 else base
                for i, (a, b) in enumerate(zip(got[0] + got[1], base[0] + base[1])):
                    checks.equal(a, b, f"{path} tp={tp} tensor {i} vs tp=1")
    checks.done()


@world.case
def test_temperature_that_differs_across_tp_ranks_is_refused():
    hidden, weight, target, temps = _data()
    _, group, rank = tp_member(4)
    start, end = vocab_shard_ranges(V, 4, multiple=256)[rank]
    x = hidden @ weight[start:end].t()
    t = temps["token"].clone()
    t[0, 0] += 0.25 * (rank == 2)  # one rank's temperature is off by one token
    calls = {
        "vocab_parallel_cross_entropy": lambda inv: vocab_parallel_cross_entropy(
            x, target, tp_group=group, vocab_size=V, temperature=t, invariant=inv
        ),
        "vocab_parallel_entropy": lambda inv: vocab_parallel_entropy(
            x, tp_group=group, vocab_size=V, temperature=t, invariant=inv
        ),
        "fused_linear_logprobs": lambda inv: fused_linear_logprobs(
            hidden,
            weight[start:end],
            target,
            tp_group=group,
            vocab_size=V,
            temperature=t,
            invariant=inv,
        ),
    }
    for what, call in calls.items():
        for inv in (False, True):
            try:
                call(inv)
            except AgreementError as exc:
                assert "temperature (fingerprint)" in str(exc), (what, inv, str(exc))
            else:
                raise AssertionError(f"{what} invariant={inv}: no AgreementError")


@world.case
def test_invariant_new_options_ignore_token_order():
    """A permutation of the tokens (with their temperatures) permutes every output bit for
    bit, TP 4 against TP 1, and the materialized ``d logits`` rows likewise (``d hidden``
    and ``d weight`` under permutation)."""
    hidden, weight, target, temps = _data()
    api, opts = _opts("lp-token-T-all", temps)
    perm = torch.randperm(B * S, generator=torch.Generator().manual_seed(3)).to(hidden.device)

    def permuted(x):
        return x.reshape(B * S, *x.shape[2:])[perm].reshape(x.shape)

    p_opts = dict(opts, temperature=permuted(opts["temperature"]))
    p_args = (permuted(hidden), weight, permuted(target))
    checks = Checks()
    for path in ("materialized_inv", "fused_inv"):
        base = _run(path, api, opts, hidden, weight, target, 1)
        got = _run(path, api, p_opts, *p_args, 4, order=perm)
        for i, (a, b) in enumerate(zip(got[0], base[0], strict=True)):
            checks.equal(a, permuted(b), f"{path} output {i} permuted")
        if path == "materialized_inv":
            checks.equal(got[1][0], permuted(base[1][0]), f"{path} d logits permuted")
    checks.done()


# ------------------------------------------------------------------ per-class weights
CE_CASES = {
    "smooth-mean-z": {"label_smoothing": 0.1, "reduction": "mean", "z_loss_weight": 1e-3},
    "smooth-none-T-cap": {
        "label_smoothing": 0.2,
        "reduction": "none",
        "temperature": 0.8,
        "softcap": 3.0,
    },
}


def _ce_weight(device):
    """``[V]`` weights in [0.2, 2.2), two classes at 0."""
    w = torch.rand(V, generator=torch.Generator().manual_seed(11)) * 2 + 0.2
    w[[3, 600]] = 0.0
    return w.to(device)


def _ce_oracle(path, opts, hidden, weight, target, ce_weight):
    def outputs(z):
        return [weighted_cross_entropy(z, target, ce_weight, **opts)]

    def ups(outs):
        return _ups(outs[0].shape, 1, hidden.device, torch.float64)

    return fp64_oracle(path.startswith("materialized"), hidden, weight, V, outputs, ups)


@world.case
def test_ce_weight_fp64_at_tp_1_2_4_and_invariant_bitwise():
    hidden, weight, target, _ = _data()
    ce_weight = _ce_weight(hidden.device)
    checks = Checks()
    for name, opts in CE_CASES.items():
        for path in PATHS:
            ref = _ce_oracle(path, opts, hidden, weight, target, ce_weight)
            base = None
            for tp in (1, 2, 4):
                got = _run(path, "ce", dict(opts, ce_weight=ce_weight), hidden, weight, target, tp)
                what, inv = f"{name} {path} tp={tp}", path.endswith("_inv")
                base = checks.tp_point(what, got, ref, base, inv)
    checks.done()


@world.case
def test_ce_weight_that_differs_across_tp_ranks_or_is_a_shard_is_refused():
    """A weight off on one rank: the same ``AgreementError`` on every rank; this rank's
    shard of the weights: a ``ValueError`` on every rank from the parse, before any
    collective (nobody waits)."""
    hidden, weight, target, _ = _data()
    ce_weight = _ce_weight(hidden.device)
    _, group, rank = tp_member(4)
    start, end = vocab_shard_ranges(V, 4, multiple=256)[rank]
    off = ce_weight.clone()
    off[10] += 0.5 * (rank == 2)  # one rank's weights differ in one class
    x = hidden @ weight[start:end].t()
    for inv in (False, True):
        for door in ("vocab_parallel_cross_entropy", "fused_linear_cross_entropy"):
            args = (x,) if door.startswith("vocab") else (hidden, weight[start:end])
            fn = globals()[door]
            kw = dict(tp_group=group, vocab_size=V, invariant=inv)
            with pytest.raises(AgreementError, match=r"ce_weight \(fingerprint\)"):
                fn(*args, target, ce_weight=off, **kw)
            rows = ce_weight[start:end].shape[0]  # the last rank's rows stop at V
            with pytest.raises(ValueError, match=rf"ce_weight shape \({rows},\) must be"):
                fn(*args, target, ce_weight=ce_weight[start:end], **kw)
