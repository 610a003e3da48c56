"""Per-token temperature, sum_pi_squared, reduction= and the entropy's ignore_index on one
process: every loss API x materialized / fused x invariant or not against the fp64
reference of ``tests/loss_refs.py`` (plain torch on the full logits); the validation
of a temperature tensor; the option names and defaults shared by every API."""

from __future__ import annotations

import inspect

import pytest
import torch

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from tests.loss_refs import reference, sum_pi_squared

V, H, B, S = 600, 24, 5, 14  # 600 ids: 3 blocks of 256, the last one partial
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv")
# fp32 against fp64: blocked / chunked online log-sum-exp and fp32 matmuls reorder fp32
# sums of <= 600 terms of size <= ~10 (~1e-6 relative); a per-token 1 / T is one more
# fp32 rounding. 2e-5 still catches a wrong term (a wrong T moves values by > 1e-2).
FP32 = dict(rtol=2e-5, atol=2e-5)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.6  # logits ~ N(0, 3^2)
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, 3], target[2, :4] = -100, -100
    return hidden, weight, target


def _temperatures():
    g = torch.Generator().manual_seed(5)
    return {
        "token": torch.rand(B, S, generator=g) * 1.5 + 0.3,
        "sample": torch.rand(B, 1, generator=g) * 1.5 + 0.3,
        "scalar": torch.tensor(0.7),
    }


def _ups(shape, count, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) + 0.5 for _ in range(count)]


def _call(api, path, hidden, weight, target, **opts):
    """``(outputs, grads)`` of ``sum(up_i * out_i)`` over the differentiable outputs."""
    inv = path.endswith("_inv")
    if path.startswith("materialized"):
        x = (hidden @ weight.t()).requires_grad_()
        leaves = [x]
        if api == "ent":
            out = vocab_parallel_entropy(x, target=target, invariant=inv, **opts)
        else:
            fn = vocab_parallel_cross_entropy if api == "ce" else vocab_parallel_logprobs
            out = fn(x, target, invariant=inv, **opts)
    else:
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        fn = fused_linear_cross_entropy if api == "ce" else fused_linear_logprobs
        opts = {"reduction": "none", **opts} if api == "ce" else opts
        out = fn(*leaves, target, invariant=inv, chunk_size=29, **opts)
    outs = out if isinstance(out, tuple) else (out,)
    ups = _ups(outs[0].shape, len(outs))
    sum((o * u).sum() for o, u in zip(outs, ups) if o.requires_grad).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves], outs


def _reference(api, path, hidden, weight, target, **opts):
    ignore = opts.get("ignore_index", -100)
    kw = {k: opts[k] for k in ("temperature", "softcap", "label_smoothing") if k in opts}
    if path.startswith("materialized"):
        leaves = [(hidden @ weight.t()).double().requires_grad_()]
        z = leaves[0]
    else:
        leaves = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
        z = leaves[0] @ leaves[1].t()
    kind = "ce" if api == "ce" else "logprob"
    value, entropy, _ = reference(z, target, kind=kind, ignore_index=ignore, **kw)
    outs = [entropy] if api == "ent" else [value]
    if opts.get("return_entropy"):
        outs.append(entropy)
    if opts.get("return_sum_pi_squared"):
        outs.append(sum_pi_squared(z, target, ignore_index=ignore, **kw).detach())
    reduction = opts.get("reduction", "none")
    if reduction != "none":
        counted = (target != ignore).sum() if ignore is not None else target.numel()
        outs = [o.sum() / (counted if reduction == "mean" else 1) for o in outs]
    ups = _ups(outs[0].shape, len(outs))
    sum((o * u.double()).sum() for o, u in zip(outs, ups) if o.requires_grad).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _check(ours, ref):
    assert len(ours[0]) == len(ref[0])
    for a, b in zip(ours[0] + ours[1], ref[0] + ref[1], strict=True):
        torch.testing.assert_close(a.double(), b, **FP32)


def _apis(path):
    return ("ce", "lp", "ent") if path.startswith("materialized") else ("ce", "lp")


CASES = [(p, a) for p in PATHS for a in _apis(p)]


@pytest.mark.parametrize(("path", "api"), CASES)
@pytest.mark.parametrize("which", ["token", "sample", "scalar"])
def test_tensor_temperature_matches_fp64(path, api, which):
    hidden, weight, target = _inputs()
    opts = {"temperature": _temperatures()[which], "softcap": 2.5}
    if api == "ce":
        opts["label_smoothing"] = 0.1
    _check(
        _call(api, path, hidden, weight, target, **opts)[:2],
        _reference(api, path, hidden, weight, target, **opts),
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entropy", [False, True])
def test_sum_pi_squared_matches_fp64_and_has_no_gradient(path, entropy):
    hidden, weight, target = _inputs()
    opts = {
        "temperature": _temperatures()["token"],
        "softcap": 2.5,
        "return_entropy": entropy,
        "return_sum_pi_squared": True,
    }
    outs, grads, raw = _call("lp", path, hidden, weight, target, **opts)
    _check((outs, grads), _reference("lp", path, hidden, weight, target, **opts))
    assert len(outs) == 2 + entropy and not raw[-1].requires_grad
    assert (outs[-1][target == -100] == 0).all()
    plain = _call("lp", path, hidden, weight, target, temperature=opts["temperature"], softcap=2.5)
    assert torch.equal(plain[0][0], outs[0]), "asking for sum_pi_squared moved a log-prob bit"


@pytest.mark.parametrize(("path", "api"), CASES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduction_matches_fp64(path, api, reduction):
    hidden, weight, target = _inputs()
    opts = {"reduction": reduction, "temperature": 0.8}
    if api == "lp":
        opts.update(return_entropy=True, return_sum_pi_squared=True)
    ours = _call(api, path, hidden, weight, target, **opts)
    assert all(o.dim() == 0 for o in ours[0])
    _check(ours[:2], _reference(api, path, hidden, weight, target, **opts))


@pytest.mark.parametrize(("path", "api"), CASES)
def test_mean_over_only_ignored_tokens_is_nan_with_zero_gradients(path, api):
    hidden, weight, target = _inputs()
    target = torch.full_like(target, -100)
    outs, grads, _ = _call(api, path, hidden, weight, target, reduction="mean")
    assert torch.isnan(outs[0])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("invariant", [False, True])
def test_entropy_without_target_counts_every_token(invariant):
    hidden, weight, _ = _inputs()
    x = hidden @ weight.t()
    t = _temperatures()["sample"]
    ent = vocab_parallel_entropy(x, temperature=t, softcap=2.5, invariant=invariant)
    ref = reference(
        x, torch.zeros(B, S, dtype=torch.long), kind="logprob", temperature=t, softcap=2.5
    )
    torch.testing.assert_close(ent.double(), ref[1], **FP32)
    mean = vocab_parallel_entropy(x, temperature=t, invariant=invariant, reduction="mean")
    full = vocab_parallel_entropy(x, temperature=t, invariant=invariant)
    torch.testing.assert_close(mean, full.mean(), rtol=1e-6, atol=0)


def test_constant_tensor_temperature_is_the_float_temperature():
    hidden, weight, target = _inputs()
    for path in PATHS:
        for api in _apis(path):
            a = _call(api, path, hidden, weight, target, temperature=0.7)
            b = _call(api, path, hidden, weight, target, temperature=torch.full((B, 1), 0.7))
            for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_bad_temperature_tensors_are_clear_errors():
    hidden, weight, target = _inputs()
    x = hidden @ weight.t()
    calls = [
        lambda t: vocab_parallel_cross_entropy(x, target, temperature=t),
        lambda t: vocab_parallel_logprobs(x, target, temperature=t, invariant=True),
        lambda t: vocab_parallel_entropy(x, temperature=t),
        lambda t: fused_linear_cross_entropy(hidden, weight, target, temperature=t),
        lambda t: fused_linear_logprobs(hidden, weight, target, temperature=t, invariant=True),
    ]
    good = torch.ones(B, S)
    for call in calls:
        with pytest.raises(TypeError, match="temperature must be a floating tensor"):
            call(torch.ones(B, S, dtype=torch.long))
        with pytest.raises(ValueError, match="temperature is on meta but"):
            call(torch.ones(B, S, device="meta"))
        with pytest.raises(ValueError, match="temperature requires grad.*temperature.detach"):
            call(good.clone().requires_grad_())
        with pytest.raises(
            ValueError, match=r"temperature shape \(5,\) must broadcast.*\[:, None\]"
        ):
            call(torch.ones(B))
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            t = good.clone()
            t[1, 2] = bad
            with pytest.raises(ValueError, match="temperature must be finite and > 0 everywhere"):
                call(t)
        with pytest.raises(
            TypeError,
            match=r"temperature must be a float, got .*; pass a float or a floating tensor",
        ):
            call("0.7")


def test_bad_reduction_and_ignore_index():
    hidden, weight, target = _inputs()
    x = hidden @ weight.t()
    for fn in (vocab_parallel_cross_entropy, vocab_parallel_logprobs):
        with pytest.raises(ValueError, match="reduction='avg' must be one of"):
            fn(x, target, reduction="avg")
        with pytest.raises(TypeError, match="ignore_index must be an int or None"):
            fn(x, target, ignore_index=-100.0)
    with pytest.raises(ValueError, match="reduction='avg' must be one of"):
        vocab_parallel_entropy(x, reduction="avg")
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_entropy(x, target=target[:, :3])


API = {
    "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
    "vocab_parallel_logprobs": vocab_parallel_logprobs,
    "vocab_parallel_entropy": vocab_parallel_entropy,
    "fused_linear_cross_entropy": fused_linear_cross_entropy,
    "fused_linear_logprobs": fused_linear_logprobs,
}
# Same meaning, same default on every API. reduction is the exception, kept for existing
# callers: per token on the materialized APIs (Megatron's vocab_parallel_cross_entropy)
# and the log-probs, "mean" on the fused cross-entropy (F.cross_entropy, Liger).
SHARED = {
    "tp_group": None,
    "vocab_size": None,
    "temperature": 1.0,
    "softcap": None,
    "ignore_index": -100,
    "invariant": False,
}


@pytest.mark.parametrize("name", list(API))
def test_every_api_has_the_shared_options_with_one_default(name):
    params = inspect.signature(API[name]).parameters
    for option, default in SHARED.items():
        assert params[option].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[option].default == default, (name, option)
    want = "mean" if name == "fused_linear_cross_entropy" else "none"
    assert params["reduction"].default == want
    if "logprobs" in name:
        assert params["return_entropy"].default is False
        assert params["return_sum_pi_squared"].default is False


@pytest.mark.parametrize("path", PATHS)
def test_low_precision_temperature_tensor_is_read_exactly(path):
    """A bf16 temperature is widened exactly: the same bits as its fp32 copy."""
    hidden, weight, target = _inputs()
    t16 = _temperatures()["token"].to(torch.bfloat16)
    for api in _apis(path):
        a = _call(api, path, hidden, weight, target, temperature=t16)
        b = _call(api, path, hidden, weight, target, temperature=t16.float())
        for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
            assert torch.equal(x, y), (api, path)
