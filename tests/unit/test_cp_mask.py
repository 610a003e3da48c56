"""packed_sequence_mask against a brute-force mask built from a hand-written CP cut."""

from __future__ import annotations

import pytest
import torch

from mp_bridge.comm import packed_sequence_mask


def _ref_local_tokens(bounds: list[int], cp: int, rank: int) -> list[int]:
    """Independent cut: per sequence, chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if cp == 1:
            out += list(range(start, end))
            continue
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += list(range(start + c * chunk, start + (c + 1) * chunk))
    return out


def _ref_mask(bounds: list[int], cp: int, rank: int) -> torch.Tensor:
    def seq_of(token: int) -> int:
        return next(i for i in range(len(bounds) - 1) if bounds[i] <= token < bounds[i + 1])

    queries = _ref_local_tokens(bounds, cp, rank)
    keys = [t for r in range(cp) for t in _ref_local_tokens(bounds, cp, r)]  # gather order
    rows = [[seq_of(q) == seq_of(k) for k in keys] for q in queries]
    return torch.tensor(rows, dtype=torch.bool)


def test_literal_two_sequences_cp2():
    # cu=[0, 4, 8]: rank 0 holds [0, 3, 4, 7]; keys arrive as [0, 3, 4, 7, 1, 2, 5, 6].
    a, b = [1, 1, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 1, 1]
    expected = torch.tensor([a, a, b, b], dtype=torch.bool)
    assert torch.equal(packed_sequence_mask([0, 4, 8], 2, 0), expected)


@pytest.mark.parametrize(
    "bounds, cp",
    [
        ([0, 8], 1),
        ([0, 3, 8, 9], 1),
        ([0, 4, 12], 2),
        ([0, 8, 8, 24], 2),  # an empty sequence
        ([0, 12, 18, 36], 3),
        ([0, 8, 16, 40, 48], 4),
    ],
)
def test_matches_brute_force(bounds, cp):
    for rank in range(cp):
        got = packed_sequence_mask(torch.tensor(bounds), cp, rank, seq_len=bounds[-1])
        assert got.dtype == torch.bool and got.shape == (bounds[-1] // cp, bounds[-1])
        assert torch.equal(got, _ref_mask(bounds, cp, rank)), (bounds, cp, rank)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="divisible by 2·cp=4"):
        packed_sequence_mask([0, 6], 2, 0)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\]=8 must equal .* 16"):
        packed_sequence_mask([0, 8], 2, 0, seq_len=16)
    with pytest.raises(ValueError, match="cp_rank=2 is out of range for cp_size=2"):
        packed_sequence_mask([0, 8], 2, 2)
