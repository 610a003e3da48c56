"""Per-class cross-entropy weights (``ce_weight``) on one process: both cross-entropy
doors x default / invariant (the fused door on the torch and the ``"triton"`` engine, its
kernels under ``TRITON_INTERPRET=1``) against torch's own ``F.cross_entropy(weight=)`` in
fp64 on the full logits (smoothing, ``ignore_index``, every reduction; temperature,
soft-cap and the unweighted z-loss), bad weights refused by name, and ``"auto"`` picking
the triton engine with them.

Shapes: 5 x 9 tokens (two ignored), H = 24, V = 600 (3 blocks of 256, the last partial);
weights in [0.2, 2.2) with three classes at 0 (one of them a target's).
"""

from __future__ import annotations

import pytest
import torch

from mp_bridge.layers import fused_linear_cross_entropy, vocab_parallel_cross_entropy
from tests.loss_refs import fp64_oracle, weighted_cross_entropy

V, H, B, S = 600, 24, 5, 9
PATHS = ("materialized", "materialized_inv", "fused", "fused_inv", "triton", "triton_inv")
# fp32 against fp64: as tests/unit/test_loss_token_options.py (fp32 sums of <= 600 terms
# and one fp32 rounding of the mean's weight scale); a dropped or unweighted term moves
# values by > 1e-3 with these weights.
FP32 = dict(rtol=2e-5, atol=2e-5)

CASES = {
    "mean": {"reduction": "mean"},
    "smooth-none": {"label_smoothing": 0.1, "reduction": "none"},
    "smooth-sum": {"label_smoothing": 0.2, "reduction": "sum"},
    "smooth-mean-T-cap-z": {
        "label_smoothing": 0.1,
        "reduction": "mean",
        "temperature": 0.7,
        "softcap": 3.0,
        "z_loss_weight": 1e-3,
    },
    "token-T-z-none": {"reduction": "none", "temperature": "token", "z_loss_weight": 2e-3},
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.6
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, 3], target[2, 4] = -100, -100
    ce_weight = torch.rand(V, generator=g) * 2 + 0.2
    ce_weight[[7, 300, int(target[1, 1])]] = 0.0  # a zero-weight target among them
    temp = torch.rand(B, S, generator=g) * 1.5 + 0.3
    return hidden, weight, target, ce_weight, temp


def _options(name, temp):
    opts = dict(CASES[name])
    if opts.get("temperature") == "token":
        opts["temperature"] = temp
    return opts


def _ours(path, hidden, weight, target, ce_weight, opts):
    inv = path.endswith("_inv")
    if path.startswith("materialized"):
        leaves = [(hidden @ weight.t()).requires_grad_()]
        out = vocab_parallel_cross_entropy(
            leaves[0], target, ce_weight=ce_weight, invariant=inv, **opts
        )
    else:
        if path.startswith("triton"):
            pytest.importorskip("triton")
            opts = dict(opts, engine="triton")
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        out = fused_linear_cross_entropy(
            *leaves, target, ce_weight=ce_weight, invariant=inv, chunk_size=29, **opts
        )
    return out, leaves


def _oracle(path, hidden, weight, target, ce_weight, opts):
    """``(outputs, grads)`` of the fp64 reference, upstream gradients ``_up``."""

    def outputs(z):
        return [weighted_cross_entropy(z, target, ce_weight, **opts)]

    materialized = path.startswith("materialized")
    return fp64_oracle(materialized, hidden, weight, V, outputs, lambda o: [_up(o[0])])


def _up(out):
    return (torch.rand(out.shape, generator=torch.Generator().manual_seed(7)) + 0.5).to(out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(CASES))
def test_ce_weight_matches_torch_cross_entropy(path, name):
    hidden, weight, target, ce_weight, temp = _inputs()
    opts = _options(name, temp)
    out, leaves = _ours(path, hidden, weight, target, ce_weight, opts)
    (out * _up(out)).sum().backward()
    (ref,), ref_grads = _oracle(path, hidden, weight, target, ce_weight, opts)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **FP32)
    for ours, theirs in zip(leaves, ref_grads, strict=True):
        torch.testing.assert_close(ours.grad.double(), theirs, **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_ce_weight_changes_the_loss_and_z_loss_stays_unweighted(path):
    """The weighted loss differs from the unweighted one (the option is not ignored);
    the returned z-loss does not depend on the weights, whatever their scale."""
    hidden, weight, target, ce_weight, _ = _inputs()
    kw = {"reduction": "mean", "z_loss_weight": 1e-3, "return_z_loss": True}
    plain, _ = _ours(path, hidden, weight, target, None, kw)
    weighted, _ = _ours(path, hidden, weight, target, ce_weight, kw)
    scaled, _ = _ours(path, hidden, weight, target, ce_weight * 8, kw)
    assert (weighted[0] - plain[0]).abs() > 1e-3
    torch.testing.assert_close(weighted[0], scaled[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weighted[1], plain[1], rtol=0, atol=0)
    torch.testing.assert_close(scaled[1], plain[1], rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_mean_whose_counted_targets_all_weigh_zero_is_nan_like_torch(path):
    hidden, weight, target, ce_weight, _ = _inputs()
    zero = ce_weight.clone()
    zero[target[target >= 0]] = 0.0
    out, _ = _ours(path, hidden, weight, target, zero, {"reduction": "mean"})
    (ref,), _ = _oracle(path, hidden, weight, target, zero, {"reduction": "mean"})
    assert torch.isnan(ref) and torch.isnan(out)


BAD = [
    ("list", lambda: [1.0] * V, TypeError, "ce_weight must be a floating torch.Tensor"),
    ("int", lambda: torch.ones(V, dtype=torch.long), TypeError, "dtype=torch.int64"),
    ("shape", lambda: torch.ones(768), ValueError, "ce_weight shape (768,) must be"),
    ("2d", lambda: torch.ones(1, V), ValueError, "ce_weight shape (1, 600) must be"),
    ("grad", lambda: torch.ones(V, requires_grad=True), ValueError, "ce_weight.detach()"),
    ("negative", lambda: torch.ones(V).index_fill_(0, torch.tensor([5]), -0.5), ValueError,
     "finite and >= 0 everywhere, got -0.5"),
    ("nan", lambda: torch.ones(V).index_fill_(0, torch.tensor([5]), float("nan")), ValueError,
     "finite and >= 0"),
    ("meta", lambda: torch.ones(V, device="meta"), ValueError, "ce_weight is a meta tensor"),
]  # fmt: skip


@pytest.mark.parametrize("door", ["materialized", "fused"])
@pytest.mark.parametrize(("what", "make", "error", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_ce_weight_is_a_clear_error(door, what, make, error, message):
    hidden, weight, target, _, _ = _inputs()
    with pytest.raises(error) as exc:
        if door == "materialized":
            vocab_parallel_cross_entropy(hidden @ weight.t(), target, ce_weight=make())
        else:
            fused_linear_cross_entropy(hidden, weight, target, ce_weight=make())
    assert message in str(exc.value), str(exc.value)


def test_auto_picks_the_triton_engine_with_ce_weight():
    """The triton kernels take per-class weights: ``"auto"`` on a CUDA call picks
    ``"triton"`` with a ``ce_weight`` as without one."""
    pytest.importorskip("triton")
    from mp_bridge.layers.loss.engines.protocol import choose_engine

    inputs = (("hidden", (B * S, H), torch.float32), ("weight", (V, H), torch.float32))
    cuda = torch.device("cuda")
    assert choose_engine("auto", inputs, cuda) == "triton"
    assert choose_engine("auto", (*inputs, ("ce_weight", (V,), torch.float32)), cuda) == "triton"


@pytest.mark.parametrize("engine", ["torch", "triton"])
def test_invariant_fused_ce_weight_is_bitwise_the_same_at_every_chunk_size(engine):
    if engine == "triton":
        pytest.importorskip("triton")
    hidden, weight, target, ce_weight, _ = _inputs()
    kw = {"label_smoothing": 0.1, "reduction": "none", "invariant": True, "engine": engine}
    outs = []
    for chunk in (7, 64, None):
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        out = fused_linear_cross_entropy(
            *leaves, target, ce_weight=ce_weight, chunk_size=chunk, **kw
        )
        (out * _up(out)).sum().backward()
        outs.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)
