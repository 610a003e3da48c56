"""Which full rows a DTensor shard of a padded TP shard holds, and the padding a load zeroes.

Hand-written cases: vocab 11 at TP 2 (6-row shards; TP rank 1 holds full rows 6..10 and
one padding row) under FSDP over 2 ranks (3 shard rows each): dp rank 0 holds full rows
6..8, dp rank 1 full rows 9, 10 and the padding row.
"""

from __future__ import annotations

import torch

from mp_bridge.checkpoint.dcp_adapter import PiecesTensor
from mp_bridge.checkpoint.dtensor_place import pieces_within
from mp_bridge.layers import ShardPiece, ShardSpec

TP1_OF_11 = ShardSpec(0, None, 11).pieces(6, size=2, rank=1)  # (ShardPiece(0, 6, 5),)


def test_a_dtensor_chunk_of_a_padded_tp_shard_holds_these_full_rows():
    assert TP1_OF_11 == (ShardPiece(0, 6, 5),)
    assert pieces_within(TP1_OF_11, 0, 3) == (ShardPiece(0, 6, 3),)
    assert pieces_within(TP1_OF_11, 3, 3) == (ShardPiece(0, 9, 2),)
    assert pieces_within(TP1_OF_11, 6, 0) == ()  # an empty FSDP shard
    fused = ShardSpec(0, None, 8, parts=2).pieces(4, size=2, rank=1)  # [gate_1; up_1]
    assert pieces_within(fused, 1, 2) == (ShardPiece(0, 3, 1), ShardPiece(1, 6, 1))


def test_a_load_zeroes_only_the_rows_no_piece_covers():
    local = torch.full((3, 2), 7.0)
    value = PiecesTensor(local, (11, 2), 0, pieces_within(TP1_OF_11, 3, 3), offsets=(3, 0))
    assert [tuple(c.offsets) for c in value.__create_chunk_list__()] == [(9, 0)]
    value.zero_rest()
    assert torch.equal(local, torch.tensor([[7.0, 7.0], [7.0, 7.0], [0.0, 0.0]]))
    gaps = torch.full((5, 1), 7.0)
    PiecesTensor(gaps, (8, 1), 0, [ShardPiece(1, 0, 1), ShardPiece(3, 4, 1)]).zero_rest()
    assert gaps.flatten().tolist() == [0.0, 7.0, 0.0, 7.0, 0.0]
