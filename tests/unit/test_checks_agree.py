"""agree() takes frozen specs; the row's slots; the agreement flag tools read; the deprecated
group check."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mp_bridge.checks import (
    MAX_FIELDS,
    FrozenSpec,
    agree,
    check_group,
    check_group_arg,
    in_agreement_check,
)
from mp_bridge.checks.agreement import pack_row


@dataclass(frozen=True)
class _Spec(FrozenSpec):
    op: str
    shape: tuple[int, ...]


@dataclass
class _Mutable(FrozenSpec):
    op: str


def test_frozen_spec_fields_are_its_dataclass_fields_in_order():
    assert _Spec("sum", (2, 3)).fields() == {"op": "sum", "shape": (2, 3)}


def test_agree_refuses_a_spec_that_is_not_frozen():
    with pytest.raises(TypeError, match=r"where: _Mutable must be a frozen dataclass"):
        agree("where", None, _Mutable("sum"))


def test_agree_without_a_group_raises_the_local_error_only():
    agree("where", None, _Spec("sum", (1,)))  # nothing to agree with: no collective
    with pytest.raises(ValueError, match="mine"):
        agree("where", None, _Spec("sum", (1,)), error=ValueError("mine"))
    assert not in_agreement_check()  # only true while the check's collectives run


def test_check_group_arg_is_a_deprecated_alias_of_check_group():
    with pytest.warns(DeprecationWarning, match=r"check_group_arg is deprecated.*check_group"):
        with pytest.raises(TypeError, match=r"tp_group=2 must be a torch.distributed"):
            check_group_arg("tp_group", 2)
    with pytest.raises(TypeError, match=r"tp_group=2 must be a torch.distributed"):
        check_group("tp_group", 2)


def test_the_row_pads_a_short_spec_with_zeros():
    row = pack_row(torch.tensor([1, 2, 3]))
    assert row.tolist() == [1, 2, 3] + [0] * 13
    assert MAX_FIELDS == 16  # the literal rows here are written for 16 slots


def test_the_row_folds_fields_past_its_slots_into_the_last_one():
    # 18 codes: 1..15 as they are, then 16*1 + 17*2 + 18*3 + 3 (fingerprint of 16, 17, 18)
    assert pack_row(torch.arange(1, 19)).tolist() == list(range(1, 16)) + [107]
    # the folded fields in another order: 17*1 + 16*2 + 18*3 + 3
    swapped = torch.tensor([*range(1, 16), 17, 16, 18])
    assert pack_row(swapped).tolist() == list(range(1, 16)) + [106]
    # exactly 16 codes fill the row as they are
    assert pack_row(torch.arange(1, 17)).tolist() == list(range(1, 17))
