"""seq_len_divisor (literal values) and the length checks that use it."""

from __future__ import annotations

import pytest

from mp_bridge.comm import cp_factor, seq_len_divisor


def test_literal_values():
    assert [seq_len_divisor(cp) for cp in (1, 2, 3, 4)] == [1, 4, 6, 8]
    assert seq_len_divisor(1, 3) == 1  # TP splits tokens only with sequence parallelism
    assert seq_len_divisor(1, 3, sequence_parallel=True) == 3
    assert seq_len_divisor(2, 2, sequence_parallel=True) == 8
    assert seq_len_divisor(2, 3, sequence_parallel=True) == 12
    assert seq_len_divisor(3, 1, sequence_parallel=True) == 6


def test_cp_factor_is_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match=r"use seq_len_divisor\(cp\)"):
        assert [cp_factor(cp) for cp in (1, 2, 3)] == [1, 4, 6]


@pytest.mark.parametrize(
    "args, kwargs, exc, text",
    [
        ((0,), {}, ValueError, "cp_size=0 must be an int >= 1"),
        ((2.0,), {}, TypeError, "cp_size must be an int"),
        ((2, 0), {}, ValueError, "tp_size=0 must be an int >= 1"),
        ((2, 2), {"sequence_parallel": 1}, TypeError, "sequence_parallel must be True or False"),
    ],
)
def test_bad_input(args, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        seq_len_divisor(*args, **kwargs)
