"""Invariant mode at TP = 1 (single process) on the caller's unpadded tensors.

``invariant=True`` at TP = 1 (``tp_group=None``) on the *unpadded* full logits ``[N, V]``
  / full weight ``[V, H]`` (V not a multiple of 256) gives the same bits as the block-padded
layout that TP = 2, 4, 8 (``multiple=256``) evaluate. Exactness: ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
)


def _problem(vocab: int, n: int = 70, h: int = 16):
    gen = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, h, generator=gen) / 4
    hidden = torch.randn(n, h, generator=gen)
    target = torch.randint(0, vocab, (n,), generator=gen)
    target[0] = vocab - 1
    padded = torch.cat([weight, weight.new_zeros(-(-vocab // 256) * 256 - vocab, h)])
    return weight, padded, hidden, target


@pytest.mark.parametrize("vocab", [7, 1001, 4099])
def test_invariant_tp1_unpadded_logits_equal_padded_bitwise(vocab):
    _, padded, hidden, target = _problem(vocab)
    full = hidden @ padded.t()  # the same logits values in both calls
    runs = []
    for logits in (full[:, :vocab], full):
        x = logits.clone().requires_grad_()
        lp = vocab_parallel_logprobs(x, target, vocab_size=vocab, temperature=0.8, invariant=True)
        lp.sum().backward()
        y = logits.clone().requires_grad_()
        ce = vocab_parallel_cross_entropy(
            y, target, vocab_size=vocab, label_smoothing=0.1, invariant=True
        )
        ce.sum().backward()
        runs.append((lp, x.grad[:, :vocab], ce, y.grad[:, :vocab]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    # and the default-path reference (tolerance: fp32 sums over <= 4099 terms)
    ref = torch.log_softmax(full[:, :vocab] / 0.8, -1).gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(runs[0][0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [7, 1001])
def test_invariant_tp1_unpadded_weight_equal_padded_bitwise(vocab):
    weight, padded, hidden, target = _problem(vocab)
    runs = []
    for w0 in (weight, padded):
        w, h = w0.clone().requires_grad_(), hidden.clone().requires_grad_()
        lp = fused_linear_logprobs(h, w, target, vocab_size=vocab, chunk_size=13, invariant=True)
        lp.sum().backward()
        w2, h2 = w0.clone().requires_grad_(), hidden.clone().requires_grad_()
        ce = fused_linear_cross_entropy(h2, w2, target, vocab_size=vocab, invariant=True)
        ce.backward()
        runs.append((lp, h.grad, w.grad[:vocab], ce, h2.grad, w2.grad[:vocab]))
    assert runs[0][2].shape == (vocab, hidden.shape[1])  # the caller's weight shape
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_invariant_tp1_unaligned_still_checks_vocab_size():
    with pytest.raises(ValueError, match="vocab_size=1001 must be in"):
        vocab_parallel_logprobs(
            torch.randn(3, 1000), torch.zeros(3, dtype=torch.long), vocab_size=1001, invariant=True
        )
