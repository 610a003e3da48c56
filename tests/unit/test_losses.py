"""Edge semantics of the vocab-parallel losses in one process (``tp_group=None`` = TP 1).

Oracles are torch on the full tensors: ``F.cross_entropy`` / ``log_softmax`` / entropy in
fp64 on the same (rounded) values. Tolerances are stated per check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)

V, PADDED, H = 10, 12, 6  # true vocab, padded vocab (2 padding columns / rows)


def _logits(n: int = 5, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(n, PADDED, generator=g)).to(dtype)


def _lm(n: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g)
    weight[V:] = 0  # padding rows of a from_full shard
    return hidden, weight


TARGET = torch.tensor([0, 9, -100, 4, 7])

MATERIALIZED = {
    "ce": lambda z, t: vocab_parallel_cross_entropy(z, t, vocab_size=V, label_smoothing=0.1),
    "logprobs": lambda z, t: vocab_parallel_logprobs(
        z, t.clamp(min=0), vocab_size=V, temperature=0.7
    ),
}
FUSED = {
    "ce_mean": lambda h, w, t: fused_linear_cross_entropy(
        h, w, t, vocab_size=V, label_smoothing=0.1, chunk_size=2
    ),
    "ce_none": lambda h, w, t: fused_linear_cross_entropy(
        h, w, t, vocab_size=V, reduction="none", chunk_size=2
    ),
    "logprobs": lambda h, w, t: fused_linear_logprobs(h, w, t.clamp(min=0), vocab_size=V),
}


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
@pytest.mark.parametrize("name", sorted(MATERIALIZED))
def test_any_integer_target_dtype_gives_the_int64_result(name, dtype):
    # Decision: every integer dtype is accepted (token ids often arrive as int32/uint16);
    # the result must be bitwise the int64 one. uint8 cannot hold -100: clamp first.
    fn = MATERIALIZED[name]
    target = TARGET.clamp(min=0) if dtype == torch.uint8 else TARGET
    z = _logits().requires_grad_()
    want = fn(z, target)
    (want_grad,) = torch.autograd.grad(want.sum(), z)
    got = fn(z, target.to(dtype))
    (grad,) = torch.autograd.grad(got.sum(), z)
    assert torch.equal(got, want) and torch.equal(grad, want_grad)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.uint8])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_any_integer_target_dtype_gives_the_int64_result(name, dtype):
    fn = FUSED[name]
    target = TARGET.clamp(min=0) if dtype == torch.uint8 else TARGET
    hidden, weight = _lm()
    h = hidden.requires_grad_()
    want = fn(h, weight, target)
    (want_grad,) = torch.autograd.grad(want.sum(), h)
    got = fn(h, weight, target.to(dtype))
    (grad,) = torch.autograd.grad(got.sum(), h)
    assert torch.equal(got, want) and torch.equal(grad, want_grad)


def test_fused_mean_over_only_ignored_tokens_is_nan_with_zero_gradients():
    # Like F.cross_entropy(reduction="mean"): the value 0/0 is nan, but no token takes
    # part, so every gradient is exactly 0 (a nan gradient would poison the optimizer).
    hidden, weight = _lm()
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    ignored = torch.full((5,), -100)
    ref = F.cross_entropy(F.linear(h, w)[:, :V], ignored)
    ref_grads = torch.autograd.grad(ref, (h, w))
    for invariant in (False, True):
        ww = w if not invariant else torch.zeros(256, H).requires_grad_()
        loss = fused_linear_cross_entropy(h, ww, ignored, vocab_size=V, invariant=invariant)
        gh, gw = torch.autograd.grad(loss * 3, (h, ww))
        assert torch.isnan(loss) and torch.isnan(ref)
        assert torch.equal(gh, ref_grads[0]) and torch.all(gw == 0), invariant


def test_double_backward_raises_instead_of_a_wrong_second_derivative():
    # The backward formulas use saved forward statistics: they are not differentiable, so
    # create_graph must end in a clear error, never in a silently wrong Hessian.
    z = _logits(dtype=torch.float64).requires_grad_()
    hidden, weight = _lm()
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    calls = {
        "ce": lambda: vocab_parallel_cross_entropy(z, TARGET),
        "logprobs": lambda: vocab_parallel_logprobs(z, TARGET.clamp(min=0)),
        "entropy": lambda: vocab_parallel_entropy(z),
        "ce_invariant": lambda: vocab_parallel_cross_entropy(z, TARGET, invariant=True),
        **{f"fused_{k}": (lambda f=f: f(h, w, TARGET)) for k, f in FUSED.items()},
    }
    for name, call in calls.items():
        inputs = (h, w) if name.startswith("fused") else (z,)
        with pytest.raises(RuntimeError, match="cannot differentiate twice"):
            torch.autograd.grad(call().sum(), inputs, create_graph=True)
        assert all(g is not None for g in torch.autograd.grad(call().sum(), inputs)), name


def test_fused_backward_twice_names_the_fix():
    hidden, weight = _lm()
    h = hidden.requires_grad_()
    loss = fused_linear_cross_entropy(h, weight, TARGET, vocab_size=V)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"retain_graph.*reduction='none'"):
        loss.backward()
    # reduction="none" recomputes in backward, so a retained graph can be reused.
    h.grad = None
    out = fused_linear_cross_entropy(h, weight, TARGET, vocab_size=V, reduction="none")
    out.sum().backward(retain_graph=True)
    first = h.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(h.grad, 2 * first, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_inputs_match_fp64_torch_and_are_not_modified(dtype):
    # Values accumulate in fp32 from the same rounded inputs: 1e-5 relative (a few fp32
    # ulps of sums over 10 terms). Gradients are returned in the input dtype: one rounding,
    # 2**-11 (fp16) / 2**-8 (bf16) relative, plus fp32 ulps for fp32.
    rtol = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-5}[dtype]
    z = _logits(dtype=dtype, seed=3)
    before = z.clone()
    t = TARGET.clamp(min=0)
    refs = {
        "ce": lambda x: F.cross_entropy(x, TARGET, label_smoothing=0.3, reduction="none"),
        "logprobs": lambda x: torch.log_softmax(x / 0.7, -1).gather(1, t[:, None])[:, 0],
        "entropy": lambda x: -(torch.log_softmax(x, -1).exp() * torch.log_softmax(x, -1)).sum(-1),
    }
    ours = {
        "ce": lambda x: vocab_parallel_cross_entropy(x, TARGET, vocab_size=V, label_smoothing=0.3),
        "logprobs": lambda x: vocab_parallel_logprobs(x, t, vocab_size=V, temperature=0.7),
        "entropy": lambda x: vocab_parallel_entropy(x, vocab_size=V),
    }
    up = torch.linspace(-2, 2, 5)
    for name in refs:
        leaf = z.double().requires_grad_()
        ref = refs[name](leaf[:, :V])
        (ref_grad,) = torch.autograd.grad(ref, leaf, up.double())
        x = z.clone().requires_grad_()
        got = ours[name](x)
        (grad,) = torch.autograd.grad(got, x, up)
        assert got.dtype == torch.float32 and grad.dtype == dtype, name
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=rtol, atol=1e-6, msg=name)
        assert torch.all(grad[:, V:] == 0), f"{name}: padding columns got a gradient"
        assert torch.equal(x, before), f"{name} modified its input"


def test_non_contiguous_logits_and_single_token():
    z = _logits(n=7, seed=4)
    view = z.t().contiguous().t()[::2]  # non-contiguous rows of a column-major tensor
    assert not view.is_contiguous()
    t = torch.tensor([1, 9, -100, 0])
    got = vocab_parallel_cross_entropy(view, t, vocab_size=V, label_smoothing=0.2)
    want = F.cross_entropy(view[:, :V], t, label_smoothing=0.2, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # same fp32 sums, reordered
    one = vocab_parallel_logprobs(z[0], torch.tensor(4), vocab_size=V)
    assert one.shape == () and torch.allclose(one, torch.log_softmax(z[0, :V], -1)[4])


def test_label_smoothing_and_ignore_index_arguments():
    z = _logits()
    with pytest.raises(TypeError, match="label_smoothing must be a float, got True"):
        vocab_parallel_cross_entropy(z, TARGET, label_smoothing=True)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        vocab_parallel_cross_entropy(z, TARGET, ignore_index=1.5)
    # ignore_index may be a real id; every token ignored -> zeros and zero gradient.
    x = z.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, torch.full((5,), 3), ignore_index=3, label_smoothing=0.5)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    assert torch.all(loss == 0) and torch.all(grad == 0)


def test_mixed_dtypes_in_the_fused_loss_name_the_fix():
    hidden, weight = _lm()
    with pytest.raises(TypeError, match=r"hidden.to\(weight.dtype\)"):
        fused_linear_cross_entropy(hidden.bfloat16(), weight, TARGET)


def test_fp64_smoothed_cross_entropy_gradient_is_fp64_exact():
    # fp64 logits keep fp64 statistics and gradients: an fp32-rounded coefficient (b =
    # -(1 - eps) = -0.9 has a relative fp32 error ~1e-8) moves the gradient by ~1e-8,
    # far above the ~1e-15 of fp64 sums of 700 terms; 1e-12 separates the two.
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(40, 700, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randint(0, 700, (40,), generator=g)
    t[::6] = -100
    temp = torch.rand(40, generator=g, dtype=torch.float64) + 0.4
    for temperature in (1.0, 0.7, temp):
        got = vocab_parallel_cross_entropy(x, t, label_smoothing=0.1, temperature=temperature)
        (grad,) = torch.autograd.grad(got.sum(), x)
        scale = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
        ref = F.cross_entropy(x / scale, t, label_smoothing=0.1, reduction="none")
        (ref_grad,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
