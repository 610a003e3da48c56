"""Rotary positions of packed documents restart at 0 (``rotary_positions`` of a padded
layout), on every CP shard of the padded cut, as the single-process reference gives them
(``reference_positions``: ``cu_seqlens`` expanded per token, written independently). The
shards' positions are the partition adapter's own (its ``position_ids``)."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.comm.sequence.padding import pad_layout
from mp_bridge.comm.sequence.partition import PartitionAdapter
from mp_bridge.layers import document_positions, rotary_positions
from mp_bridge.models.reference.model import reference_positions


def test_the_docstring_example():
    got = document_positions(torch.tensor([2, 3, 4, 7]), torch.tensor([0, 3, 8]))
    assert got.tolist() == [2, 0, 1, 4]


def test_plain_input_and_raw_bounds_keep_their_positions():
    pos = torch.arange(6).expand(2, 6)
    assert rotary_positions(pos, None) is pos
    assert rotary_positions(pos, pad_layout(6, 1)) is pos
    row = pos[0]
    assert rotary_positions(row, torch.tensor([0, 2, 6])) is row


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_each_cp_shard_gets_the_positions_of_the_unpacked_documents(cp, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 23, (5,), generator=g).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(cu[-1])
    want = reference_positions(_packed(cu))[0]  # [T]: per original token
    ids = torch.arange(1, total + 1)  # token i holds id i + 1; padding gets id 0
    for rank in range(cp):
        adapter = PartitionAdapter()
        adapter.cp_size, adapter.cp_rank = cp, rank  # the cut alone: no group needed
        shard = adapter.shard(None, input_ids=ids, cu_seqlens=cu)
        got = rotary_positions(shard.position_ids, shard.layout)
        real = shard.input_ids > 0
        assert torch.equal(got[real], want[shard.input_ids[real] - 1]), rank
        assert bool((got >= 0).all())


def _packed(cu: torch.Tensor):
    class Packed:  # the two fields reference_positions reads
        packed, cu_seqlens = True, cu

    return Packed()
