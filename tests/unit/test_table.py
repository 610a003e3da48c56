"""format_table: the one text-table formatter (literal output)."""

from __future__ import annotations

import pytest

from mp_bridge.table import format_table


def test_literal_layout():
    rows = [("rank", "encoder", "ok"), ("0", "tp=0,dp=0", "yes"), ("12", "-", "")]
    assert format_table(rows) == (
        "rank  encoder    ok\n----  ---------  ---\n0     tp=0,dp=0  yes\n12    -"
    )


def test_ragged_rows_and_empty_input_are_rejected():
    with pytest.raises(ValueError, match=r"rows \[1\] do not have 2 cells"):
        format_table([("a", "b"), ("1",)])
    with pytest.raises(ValueError, match="rows is empty"):
        format_table([])
