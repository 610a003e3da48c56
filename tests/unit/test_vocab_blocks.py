"""Canonical block tree (pure), exact identity elements, batch-independent block math."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mp_bridge.layers import VocabShard, fused_linear_logprobs
from mp_bridge.layers.loss.blocks import (
    TOKEN_TILE,
    BlockLayout,
    check_block_aligned,
    num_real_blocks,
    target_slots,
)
from mp_bridge.layers.loss.formulas import LossSpec, block_stats_, combine_stats
from mp_bridge.layers.loss.grad import softmax_grad_blocks_
from mp_bridge.layers.loss.tree import fold_tree, local_pieces, max_pieces, stream_fold


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


# ------------------------------------------------- batched block math, thread counts
def _block_layout(blocks_per_rank: int, rank: int) -> BlockLayout:
    # vocab 2500: 10 real blocks, the last one holds 196 true ids; no process group needed.
    tp = -(-10 // blocks_per_rank)
    return BlockLayout(VocabShard.of_rank(tp, blocks_per_rank * 256, rank=rank, vocab_size=2500))


def _block_math(z, target, layout, spec, tiles=slice(0, 4)):
    """Stats, then d value / d z with fixed per-token lse and factors, for ``z[tiles]``."""
    z = z.clone(memory_format=torch.contiguous_format)
    slots = target_slots(target, layout)
    with_sum = LossSpec.cross_entropy(2500, None, 0.1)  # smoothing: the sum of the logits
    stats, m = block_stats_(z, layout, slots, with_sum)
    lse = torch.linspace(4.0, 6.0, 4 * TOKEN_TILE).view(4, TOKEN_TILE)[tiles]
    w = torch.linspace(0.5, 1.5, 4 * TOKEN_TILE).view(4, TOKEN_TILE)[tiles]
    return stats, softmax_grad_blocks_(z, m, lse, w, slots, layout, spec)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_math_rows_do_not_depend_on_the_batch(threads):
    """Each row's stats and gradient have the same bits whether the batch holds 4 tiles x
    10 blocks (TP 1) or the tiles / blocks of one rank of another layout: element-wise
    kernels and row reductions over 640 Ki elements are split across threads differently
    from those over a few tiles."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        z = torch.randn(4, 10, TOKEN_TILE, 256, generator=g) * 4
        target = torch.randint(0, 2500, (4 * TOKEN_TILE,), generator=g)
        spec = LossSpec("ce", 2500, -100, 0.1)
        full_stats, full_grad = _block_math(z, target, _block_layout(10, 0), spec)
        for per, rank, tiles in ((4, 1, slice(0, 4)), (3, 3, slice(1, 3)), (2, 2, slice(3, 4))):
            layout = _block_layout(per, rank)
            blocks = slice(layout.first, layout.first + layout.num_local)
            t = target.view(4, TOKEN_TILE)[tiles].reshape(-1)
            stats, grad = _block_math(z[tiles, blocks], t, layout, spec, tiles)
            assert torch.equal(stats, full_stats[:, tiles, blocks]), (per, rank)
            assert torch.equal(grad, full_grad[tiles, blocks]), (per, rank)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_invariant_is_chunk_and_batch_invariant_at_any_thread_count(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        hidden = torch.randn(300, 32, generator=g)
        weight = torch.randn(2560, 32, generator=g) * 0.3
        target = torch.randint(0, 2500, (300,), generator=g)

        def run(h, t, chunk):
            hh = h.clone().requires_grad_(True)
            out = fused_linear_logprobs(
                hh, weight, t, vocab_size=2500, chunk_size=chunk, invariant=True
            )
            out.backward(torch.linspace(0.5, 1.5, 300)[: out.shape[0]])
            return out.detach(), hh.grad

        ref = run(hidden[:200], target[:200], 200)
        for chunk, n in ((1, 200), (64, 200), (130, 200), (300, 300), (64, 300)):
            value, grad = run(hidden[:n], target[:n], chunk)
            assert torch.equal(value[:200], ref[0]), (chunk, n)
            assert torch.equal(grad[:200], ref[1]), (chunk, n)
    finally:
        torch.set_num_threads(old)
