"""``pad_layout`` (pure) against the independent padded cut of ``route_oracle``.

For random plain lengths and packed documents, CP 1-4, TP 1-3 with and without SP: the
original index held at each local position of each (CP rank, SP piece) equals the
independent cut's, ``shard_of_position`` names the shard holding every position, the
kept positions invert the padding, and the padding stays within the stated cost.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm.sequence.padding import pad_layout
from tests.functional.route_oracle import ref_local_tokens


@settings(max_examples=200, deadline=None)
@given(
    cp=st.integers(1, 4),
    tp=st.integers(1, 3),
    sp=st.booleans(),
    packed=st.booleans(),
    lengths=st.lists(st.integers(0, 17), min_size=1, max_size=5),
)
def test_pad_layout_matches_the_independent_cut(cp, tp, sp, packed, lengths):
    pieces = tp if sp and tp > 1 else 1
    if packed:
        cu = list(itertools.accumulate([0, *lengths]))
        layout = pad_layout(cu[-1], cp, tp, sequence_parallel=sp, cu_seqlens=cu)
    else:
        cu, lengths = [0], lengths[:1]
        layout = pad_layout(lengths[0], cp, tp, sequence_parallel=sp)
    src = layout.source_index()
    shard = layout.shard_of_position()
    for c, t in itertools.product(range(cp), range(pieces)):
        want = [
            -1 if tok is None else cu[tok[0]] + tok[1]
            for tok in ref_local_tokens(lengths, packed, cp, c, pieces, t)
        ]
        local = layout.local_positions(c)
        piece = local.chunk(pieces)[t] if len(local) else local
        assert src[piece].tolist() == want
        assert (shard[piece] == c * pieces + t).all()
    kept = layout.kept_positions()
    assert src[kept].tolist() == list(range(layout.seq_len))
    f = 2 * cp if cp > 1 else 1
    bound = len(lengths) * (f - 1) + (f * pieces - f if packed else f * pieces - 1 - (f - 1))
    assert 0 <= layout.padding <= bound
    if all(n % (f * pieces) == 0 for n in lengths):
        assert layout.padding == 0


def test_pad_layout_literal_example():
    layout = pad_layout(8, 2, cu_seqlens=[0, 3, 8])
    assert layout.padded_bounds == (0, 4, 12)
    assert layout.source_index().tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1]
    # SP at tp=2 adds a padding-only document of 4 to reach a multiple of 2·cp·tp = 8.
    assert pad_layout(8, 2, 2, sequence_parallel=True, cu_seqlens=[0, 3, 8]).padded_bounds == (
        0,
        4,
        12,
        16,
    )
    assert pad_layout(11, 2).padded_len == 12 and pad_layout(11, 1).padded_len == 11
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=8 must equal"):
        pad_layout(9, 2, cu_seqlens=[0, 8])
    assert torch.equal(pad_layout(5, 2).kept_positions(), torch.arange(5))
