"""Floor 0: argument validators, the agreement check across ranks, autograd guards.

Imports torch only, never another ``mp_bridge`` package."""

from .agree import AgreementSpec, agree
from .agreement import (
    MAX_FIELDS,
    AgreementError,
    check_agreement,
    check_group_arg,
    checks_enabled,
    fingerprint,
    run_checked,
)
from .autograd import forbid_double_backward
from .validate import (
    check_bool,
    check_choice,
    check_device,
    check_dtype,
    check_float,
    check_group,
    check_groups,
    check_int,
    check_ints,
    check_positive_float,
    check_tensor,
    is_int,
)

__all__ = [
    "AgreementSpec",
    "agree",
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
    "check_tensor",
    "is_int",
]
