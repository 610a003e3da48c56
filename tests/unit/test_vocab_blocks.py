"""Canonical block tree (pure) and the exactness of its identity elements."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mp_bridge.layers.invariant import combine_stats
from mp_bridge.layers.vocab_blocks import (
    check_block_aligned,
    fold_tree,
    local_pieces,
    max_pieces,
    num_real_blocks,
    stream_fold,
)


def _expr(a: str, b: str) -> str:
    return f"({a}+{b})"


def _root_for_layout(num_real: int, tp: int) -> str:
    """The fold expression a TP layout computes: local stream folds, then the tree."""
    per = -(-num_real // tp)
    pieces = {}
    for r in range(tp):
        leaves = ((j, str(j)) for j in range(r * per, min((r + 1) * per, num_real)))
        pieces.update(dict(stream_fold(leaves, _expr)))
    return fold_tree(pieces, num_real, _expr)


def test_local_pieces_are_maximal_aligned_subtrees():
    assert local_pieces(3, 9, 8) == [(0, 3), (2, 1)]
    assert local_pieces(0, 10, 10) == [(3, 0), (1, 4)]
    assert local_pieces(5, 10, 10) == [(0, 5), (1, 3), (1, 4)]
    assert local_pieces(8, 12, 10) == [(1, 4)]  # blocks 10, 11 are padding
    assert local_pieces(10, 12, 10) == []
    assert max_pieces(5, 2, 10) == 3


def test_tree_expression_for_ten_blocks():
    assert _root_for_layout(10, 1) == "((((0+1)+(2+3))+((4+5)+(6+7)))+(8+9))"


@given(num_real=st.integers(1, 80), tp=st.integers(1, 9))
def test_every_tp_layout_computes_the_same_expression(num_real, tp):
    assert _root_for_layout(num_real, tp) == _root_for_layout(num_real, 1)


def test_stream_fold_rejects_gaps_and_tree_rejects_holes():
    with pytest.raises(ValueError, match="consecutive"):
        stream_fold([(0, "a"), (2, "b")], _expr)
    with pytest.raises(ValueError, match="leaf 1 is not covered"):
        fold_tree({(0, 0): "a", (0, 2): "c"}, 3, _expr)


def test_block_alignment_error_names_the_fix():
    check_block_aligned(512, 1024, block=256)
    with pytest.raises(ValueError, match=r"got 250 rows .* multiple=256\)"):
        check_block_aligned(250, 0, block=256, tp_size=4)
    assert num_real_blocks(2500, 256) == 10


def test_padding_partials_fold_as_exact_no_ops():
    g = torch.Generator().manual_seed(0)
    x = torch.stack(
        [
            torch.randn(64, generator=g) * 30,
            torch.rand(64, generator=g) * 9 + 1,
            torch.randn(64, generator=g),
            torch.randn(64, generator=g),
        ]
    )
    identity = torch.zeros(4, 64)
    identity[0] = float("-inf")
    assert torch.equal(combine_stats(x, identity), x)
    assert torch.equal(combine_stats(identity, x), x)
