"""vocab_shard_ranges: Megatron's padded layout, pure."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mp_bridge.layers import padded_vocab_size, vocab_shard_ranges


def test_literal_ranges():
    assert vocab_shard_ranges(1000, 4) == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    assert vocab_shard_ranges(1001, 4) == [(0, 251), (251, 502), (502, 753), (753, 1004)]
    assert vocab_shard_ranges(50257, 2, multiple=128) == [(0, 25216), (25216, 50432)]
    assert padded_vocab_size(50257, 8, multiple=128) == 51200  # megatron's GPT-2 padding


@given(st.integers(1, 10**6), st.integers(1, 16), st.integers(1, 256))
def test_ranges_tile_a_padded_vocab(vocab, tp, multiple):
    ranges = vocab_shard_ranges(vocab, tp, multiple=multiple)
    local = ranges[0][1]
    assert local % multiple == 0
    assert all(end - start == local for start, end in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(tp - 1))
    assert vocab <= ranges[-1][1] < vocab + tp * multiple


@pytest.mark.parametrize(
    "bad, text",
    [
        (dict(vocab_size=0, tp_size=1), "vocab_size=0 must be an int >= 1"),
        (dict(vocab_size=8, tp_size=0), "tp_size=0 must be an int >= 1"),
    ],
)
def test_errors(bad, text):
    with pytest.raises(ValueError, match=text):
        vocab_shard_ranges(**bad)
    with pytest.raises(TypeError, match=r"vocab_size must be an int, got 8.0"):
        vocab_shard_ranges(8.0, 2)
