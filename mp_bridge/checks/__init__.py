"""Floor 0: argument validators, the agreement check across ranks, autograd guards.

Imports torch only, never another ``mp_bridge`` package."""

from .agreement import (
    MAX_FIELDS,
    AgreementError,
    check_agreement,
    check_group_arg,
    checks_enabled,
    fingerprint,
    run_checked,
)

__all__ = [
    "MAX_FIELDS",
    "AgreementError",
    "check_agreement",
    "check_group_arg",
    "checks_enabled",
    "fingerprint",
    "run_checked",
]
