"""The shared references of ``tests/oracles.py`` pinned to literal layouts (the README's
example), so an oracle that drifted together with the code under test is caught here."""

from __future__ import annotations

import torch

from tests.oracles import cu_of, ref_cut, reference_attention, vocab_cut


def test_ref_cut_literal_layouts():
    s8 = torch.arange(8)
    assert ref_cut(s8, 0, 2, 0).tolist() == [0, 1, 6, 7]  # the CP cut: chunks i, 2cp-1-i
    assert ref_cut(s8, 0, 2, 1).tolist() == [2, 3, 4, 5]
    assert ref_cut(s8, 0, 2, 0, tp=2, t=1).tolist() == [6, 7]  # then SP across TP
    assert ref_cut(torch.arange(12), 0, 2, 1, lengths=(4, 8)).tolist() == [1, 2, 6, 7, 8, 9]
    assert ref_cut(torch.arange(7), 0, 1, 0).tolist() == list(range(7))
    assert ref_cut(torch.arange(8), 0, 2, 1, lengths=(0, 8)).tolist() == [2, 3, 4, 5]
    assert cu_of((5, 7, 3)) == [0, 5, 12, 15]


def test_reference_attention_is_causal_and_per_sequence():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    out = reference_attention(q, k, v, lengths=(2, 3))
    # The first query of each sequence sees only itself: its output is its own value.
    torch.testing.assert_close(out[:, [0, 2]], v[:, [0, 2]], rtol=0, atol=1e-6)
    # Changing the second sequence leaves the first one's outputs alone.
    v2 = v.clone()
    v2[:, 2:] += 1
    assert torch.equal(reference_attention(q, k, v2, lengths=(2, 3))[:, :2], out[:, :2])


def test_vocab_cut_literal_rows_and_padding():
    full = torch.arange(10).view(5, 2)  # vocab 5 along dim 0
    assert vocab_cut(full, 2, 1, 0).tolist() == [[4, 5], [6, 7]]
    assert vocab_cut(full, 2, 2, 0).tolist() == [[8, 9], [0, 0]]  # last row padded
    assert vocab_cut(full, 2, 3, 0).tolist() == [[0, 0], [0, 0]]  # past the vocab
    assert vocab_cut(full.t(), 3, 1, -1).tolist() == [[6, 8, 0], [7, 9, 0]]
