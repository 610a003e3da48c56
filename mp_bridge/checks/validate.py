"""Argument validators: one place for "is this an int / bool / float / dtype / group".

Each returns the validated value (normalized: ``float(...)``, ``tuple(...)``) or raises a
``TypeError`` (wrong kind) / ``ValueError`` (right kind, bad value) whose message names the
argument, shows the value and says what to pass instead. ``fix`` appends a hint specific to
the call site. Nothing here touches a process group's members: safe before any collective.

    >>> check_int("chunk_size", 0, low=1)
    Traceback (most recent call last):
    ValueError: chunk_size=0 must be an int >= 1
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_bridge.deprecations import warn_deprecated

__all__ = [
    "as_int",
    "check_bool",
    "check_choice",
    "check_device",
    "check_dtype",
    "check_float",
    "check_group",
    "check_group_arg",
    "check_groups",
    "check_int",
    "check_ints",
    "check_positive_float",
    "check_str",
    "check_tensor",
    "is_int",
]


def _hint(fix: str) -> str:
    return f"; {fix}" if fix else ""


def as_int(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (Python or NumPy, not ``bool``, not a
    tensor), else ``None``."""
    if isinstance(value, (bool, torch.Tensor)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_int(value: object) -> bool:
    """True for a Python or NumPy integer that is not a ``bool``."""
    return as_int(value) is not None


def check_int(
    name: str, value: object, *, low: int | None = None, high: int | None = None, fix: str = ""
) -> int:
    """An integer (Python or NumPy, not ``bool``) in ``[low, high]`` (either bound
    optional), returned as an ``int``."""
    original = value
    value = as_int(value)
    if value is None:
        raise TypeError(f"{name} must be an int, got {original!r}{_hint(fix)}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "" if low is None else f">= {low}"
        hi = "" if high is None else f"<= {high}"
        rng = " and ".join(p for p in (lo, hi) if p)
        raise ValueError(f"{name}={value!r} must be an int {rng}{_hint(fix)}")
    return value


def check_ints(
    name: str, values: object, *, low: int | None = None, fix: str = ""
) -> tuple[int, ...]:
    """A sequence (list/tuple) of ints, each ``>= low``; returned as a tuple."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {values!r}{_hint(fix)}")
    bad = [v for v in values if not is_int(v) or (low is not None and v < low)]
    if bad:
        kind = "ints" if low is None else f"ints >= {low}"
        raise ValueError(f"{name}={list(values)!r} must hold {kind}; bad: {bad[:4]}{_hint(fix)}")
    return tuple(values)


def check_bool(name: str, value: object, *, fix: str = "") -> bool:
    """A real ``bool`` (``"no"`` or ``0`` would be silently truthy/falsy)."""
    return _instance(name, value, bool, "True or False", repr(value), fix)


def check_str(name: str, value: object, *, fix: str = "") -> str:
    """A ``str`` (``TypeError`` naming the type given)."""
    return _instance(name, value, str, "a str", type(value).__name__, fix)


def _instance(name: str, value: object, cls: type, what: str, got: str, fix: str):
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {got}{_hint(fix)}")
    return value


def check_float(
    name: str,
    value: object,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    open_low: bool = False,
    open_high: bool = False,
    fix: str = "",
) -> float:
    """A real number (not ``bool``, not nan) in the interval; returned as ``float``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}{_hint(fix)}")
    v = float(value)
    ok = not math.isnan(v)
    ok = ok and (v > low if open_low else v >= low) and (v < high if open_high else v <= high)
    if not ok:
        if high == math.inf and open_high:  # the common "finite and >= low" form
            want = f"a finite float {'>' if open_low else '>='} {low:g}"
        else:
            lb, hb = "(" if open_low else "[", ")" if open_high else "]"
            want = f"a float in {lb}{low}, {high}{hb}"
        raise ValueError(f"{name}={value!r} must be {want}{_hint(fix)}")
    return v


def check_positive_float(name: str, value: object, *, fix: str = "") -> float:
    """A finite float > 0 (rejects 0, negatives, inf and nan)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}{_hint(fix)}")
    if not 0.0 < value < math.inf:  # also rejects nan
        raise ValueError(f"{name}={value!r} must be a finite float > 0{_hint(fix)}")
    return float(value)


def check_choice(name: str, value: object, choices: Sequence[object], *, fix: str = "") -> object:
    """One of ``choices`` (compared with ``==``; strings must match exactly)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name}={value!r} must be one of {list(choices)!r}{_hint(fix)}")
    return value


def check_dtype(
    name: str, t: torch.Tensor, allowed: Sequence[torch.dtype] | str, *, fix: str = ""
) -> torch.dtype:
    """``t.dtype`` in ``allowed`` (a list, or ``"float"`` / ``"int"`` for any of the kind)."""
    if allowed == "float":
        ok = t.dtype.is_floating_point
        want = "a floating dtype"
    elif allowed == "int":
        ok = not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool
        want = "an integer dtype"
    else:
        ok = t.dtype in tuple(allowed)
        want = f"one of {[str(d) for d in allowed]}"
    if not ok:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {want}{_hint(fix)}")
    return t.dtype


def check_tensor(
    name: str, value: object, *, dtype: Sequence[torch.dtype] | str | None = None, fix: str = ""
) -> torch.Tensor:
    """A ``torch.Tensor`` (optionally of a dtype kind, see :func:`check_dtype`)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}{_hint(fix)}")
    if dtype is not None:
        check_dtype(name, value, dtype, fix=fix)
    return value


def check_device(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """``t`` on the same device as ``like`` (a cross-device op fails deep inside torch)."""
    if t.device != like.device:
        raise ValueError(
            f"{name} is on {t.device} but {like_name} is on {like.device}; move both to one "
            f"device (e.g. {name}.to({like_name}.device))"
        )


def check_group(name: str, group: object, *, fix: str = "") -> dist.ProcessGroup | None:
    """A ``ProcessGroup`` or ``None`` (one process); not a size, a rank or a rank list."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name}={group!r} must be a torch.distributed ProcessGroup or None (one "
            f"process); pass e.g. grid.get_pg('tp'), not a size or a rank{_hint(fix)}"
        )
    return group


def check_group_arg(name: str, group: object) -> None:
    """Deprecated alias of :func:`check_group`."""
    warn_deprecated("mp_bridge.checks.check_group_arg")
    check_group(name, group)


def check_groups(
    name: str, groups: object, *, fix: str = ""
) -> tuple[dist.ProcessGroup | None, ...]:
    """A group, ``None`` or a list/tuple of distinct groups, returned as a tuple.

    A group listed twice would be reduced over twice (a silent double count).
    """
    items = list(groups) if isinstance(groups, (list, tuple)) else [groups]
    for i, g in enumerate(items):
        check_group(f"{name}[{i}]" if isinstance(groups, (list, tuple)) else name, g, fix=fix)
    real = [g for g in items if g is not None]
    if len({id(g) for g in real}) != len(real):
        raise ValueError(
            f"{name} lists the same process group twice ({items!r}); a reduction over it "
            f"would count every value twice: pass each group once{_hint(fix)}"
        )
    return tuple(items)
