"""Pure CP index functions: literal layouts, partition / balance properties, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_bridge.comm import cp_shard_indices, cp_shard_indices_packed, seq_len_divisor
from mp_bridge.comm.sequence.cut import cp_gather_order


def _ids(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int64
    return t.tolist()


def test_literal_s8_cp2():
    assert _ids(cp_shard_indices(8, 2, 0)) == [0, 1, 6, 7]
    assert _ids(cp_shard_indices(8, 2, 1)) == [2, 3, 4, 5]


def test_literal_s16_cp4():
    assert _ids(cp_shard_indices(16, 4, 0)) == [0, 1, 14, 15]
    assert _ids(cp_shard_indices(16, 4, 1)) == [2, 3, 12, 13]
    assert _ids(cp_shard_indices(16, 4, 2)) == [4, 5, 10, 11]
    assert _ids(cp_shard_indices(16, 4, 3)) == [6, 7, 8, 9]


def test_cp1_is_identity_for_any_length():
    assert _ids(cp_shard_indices(6, 1, 0)) == [0, 1, 2, 3, 4, 5]
    # Nothing to balance without CP: odd lengths are fine (2·cp applies for cp > 1 only).
    assert _ids(cp_shard_indices(7, 1, 0)) == list(range(7))
    assert _ids(cp_shard_indices_packed([0, 3, 8], 1, 0)) == list(range(8))
    assert _ids(cp_gather_order(5, 1, cu_seqlens=[0, 5])) == list(range(5))
    assert (seq_len_divisor(1), seq_len_divisor(2), seq_len_divisor(3)) == (1, 4, 6)


def test_cu_seqlens_forms():
    want = [1, 2, 6, 7, 8, 9]
    for cu in ([0, 4, 12], (0, 4, 12), np.array([0, 4, 12]), torch.tensor([0, 4, 12]).int()):
        assert _ids(cp_shard_indices_packed(cu, 2, 1)) == want, type(cu)


def test_literal_packed():
    cu = [0, 4, 12]
    assert _ids(cp_shard_indices_packed(cu, 2, 0)) == [0, 3, 4, 5, 10, 11]
    assert _ids(cp_shard_indices_packed(torch.tensor(cu), 2, 1)) == [1, 2, 6, 7, 8, 9]
    # A zero-length sequence contributes nothing.
    assert _ids(cp_shard_indices_packed([0, 4, 4], 2, 1)) == [1, 2]


def test_gather_order_literal():
    assert _ids(cp_gather_order(8, 2)) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert _ids(cp_gather_order(12, 2, cu_seqlens=[0, 4, 12])) == [
        *[0, 3, 4, 5, 10, 11],
        *[1, 2, 6, 7, 8, 9],
    ]


def test_errors_name_the_factor():
    with pytest.raises(ValueError, match=r"seq_len=6 must be divisible by 2·cp=4"):
        cp_shard_indices(6, 2, 0)
    with pytest.raises(ValueError, match=r"cp_rank=2 is out of range for cp_size=2"):
        cp_shard_indices(8, 2, 2)
    with pytest.raises(ValueError, match=r"cp_size=0 must be an int >= 1"):
        cp_shard_indices(8, 0, 0)
    with pytest.raises(TypeError, match=r"seq_len must be an int, got 8.0"):
        cp_shard_indices(8.0, 2, 0)
    with pytest.raises(ValueError, match=r"lengths \[6\] are not: pad each sequence"):
        cp_shard_indices_packed([0, 4, 10], 2, 0)
    with pytest.raises(ValueError, match=r"must start at 0"):
        cp_shard_indices_packed([4, 8], 2, 0)
    with pytest.raises(ValueError, match=r"non-decreasing"):
        cp_shard_indices_packed([0, 8, 4], 2, 0)
    with pytest.raises(TypeError, match=r"cu_seqlens must hold ints, got \[0, 4.0\]"):
        cp_shard_indices_packed([0, 4.0], 2, 0)
    with pytest.raises(TypeError, match=r"1-D integer tensor"):
        cp_shard_indices_packed(torch.tensor([0.0, 4.0]), 2, 0)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=8 must equal .* 12"):
        cp_gather_order(12, 2, cu_seqlens=[0, 8])


def _pairs(indices: list[int], start: int = 0) -> int:
    """Causal (query, key <= query) pairs of these queries within a sequence at ``start``."""
    return sum(i - start + 1 for i in indices)


cp_sizes = st.sampled_from([1, 2, 3, 4, 8])


@settings(max_examples=60, deadline=None)
@given(cp=cp_sizes, chunks=st.integers(0, 6))
def test_partition_count_and_balance(cp, chunks):
    seq_len = 2 * cp * chunks
    per_rank = [_ids(cp_shard_indices(seq_len, cp, r)) for r in range(cp)]
    flat = [i for ids in per_rank for i in ids]
    assert sorted(flat) == list(range(seq_len))  # a permutation: every token exactly once
    assert {len(ids) for ids in per_rank} == {seq_len // cp}
    assert len({_pairs(ids) for ids in per_rank}) == 1  # equal causal work on every rank


@settings(max_examples=60, deadline=None)
@given(cp=cp_sizes, chunk_counts=st.lists(st.integers(0, 4), min_size=1, max_size=5))
def test_packed_partition_per_sequence(cp, chunk_counts):
    lengths = [2 * cp * c for c in chunk_counts]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    per_rank = [_ids(cp_shard_indices_packed(cu, cp, r)) for r in range(cp)]
    assert {len(ids) for ids in per_rank} == {cu[-1] // cp}
    for start, end in zip(cu[:-1], cu[1:]):
        in_seq = [[i for i in ids if start <= i < end] for ids in per_rank]
        assert sorted(i for ids in in_seq for i in ids) == list(range(start, end))
        assert {len(ids) for ids in in_seq} == {(end - start) // cp}
        assert len({_pairs(ids, start) for ids in in_seq}) == 1
    order = _ids(cp_gather_order(cu[-1], cp, cu_seqlens=cu))
    assert order == [i for ids in per_rank for i in ids]
