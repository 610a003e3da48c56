"""``agree``: the one agreement entry point, fed by the frozen spec an entry point parsed.

Every public entry point that runs a collective (the table in
:mod:`mp_bridge.checks.entry_points`) parses its arguments once into a frozen spec (a
dataclass with a ``fields()`` method: name -> small value that every rank of the group
must hold equal, e.g. shapes, dtypes, options) and calls ``agree(where, group, spec)``
before its first collective. :class:`FrozenSpec` gives a frozen dataclass that
``fields()``::

    @dataclass(frozen=True)
    class ReduceSpec(FrozenSpec):
        op: str
        shape: tuple[int, ...]

    agree("deterministic_all_reduce", group, ReduceSpec("sum", (4,)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .agreement_check import check_agreement

__all__ = ["AgreementSpec", "FrozenSpec", "agree"]


@runtime_checkable
class AgreementSpec(Protocol):
    """A parsed, frozen argument set; ``fields()`` is what the ranks compare."""

    def fields(self) -> Mapping[str, object]: ...


class FrozenSpec:
    """Mixin for a ``@dataclass(frozen=True)`` spec: ``fields()`` are its fields, in order."""

    def fields(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def agree(
    where: str,
    group: Any,
    spec: AgreementSpec,
    *,
    identical: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    error: BaseException | None = None,
    always: bool = False,
) -> None:
    """Raise the same :class:`AgreementError` on every rank of ``group`` unless they agree.

    ``spec.fields()`` must be equal on every rank; ``identical`` tensors must be equal
    bit for bit; ``error`` is this rank's own validation error (every rank then raises,
    naming this rank). Collectives and the on/off switch: see :func:`check_agreement`.
    """
    params = getattr(spec, "__dataclass_params__", None)
    if params is not None and not params.frozen:
        raise TypeError(
            f"{where}: {type(spec).__name__} must be a frozen dataclass (frozen=True): ranks "
            "compare what the entry point parsed, which nothing may change afterwards"
        )
    fields = spec.fields()
    if not isinstance(fields, Mapping):
        raise TypeError(f"{type(spec).__name__}.fields() must return a mapping, got {fields!r}")
    check_agreement(
        where, group, fields, identical=identical, device=device, error=error, always=always
    )
