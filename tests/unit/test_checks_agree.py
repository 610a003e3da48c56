"""agree() takes frozen specs; the agreement flag tools read; the deprecated group check."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mp_bridge.checks import (
    FrozenSpec,
    agree,
    check_group,
    check_group_arg,
    in_agreement_check,
)


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
