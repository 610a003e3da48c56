"""Floor 0: argument validators, the agreement check across ranks, autograd guards.

Imports torch and ``mp_bridge.deprecations`` (floor 0 too) only, never another
``mp_bridge`` package. ``check_group_arg`` is a deprecated alias of ``check_group``."""

from .agreement import (
    MAX_FIELDS,
    AgreementError,
    AgreementSpec,
    FrozenSpec,
    agree,
    check_agreement,
    checks_enabled,
    fingerprint,
    in_agreement_check,
    run_checked,
)
from .autograd import forbid_double_backward
from .entry_points import ENTRY_POINTS, agreed, agreed_name
from .validate import (
    as_int,
    check_bool,
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_group,
    check_group_arg,
    check_groups,
    check_int,
    check_ints,
    check_positive_float,
    check_str,
    check_tensor,
    is_int,
)

__all__ = [
    "as_int",
    "AgreementSpec",
    "FrozenSpec",
    "agree",
    "ENTRY_POINTS",
    "agreed",
    "agreed_name",
    "in_agreement_check",
    "MAX_FIELDS",
    "AgreementError",
    "check_agreement",
    "check_group_arg",
    "checks_enabled",
    "fingerprint",
    "run_checked",
    "forbid_double_backward",
    "check_bool",
    "check_choice",
    "check_device",
    "check_dtype",
    "check_float",
    "check_group",
    "check_groups",
    "check_int",
    "check_ints",
    "check_positive_float",
    "check_str",
    "check_tensor",
    "is_int",
]
