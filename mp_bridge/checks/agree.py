"""``agree``: the one agreement entry point, fed by the frozen spec an entry point parsed.

Every public entry point that runs a collective parses its arguments once into a frozen
spec (a dataclass with a ``fields()`` method: name -> small value that every rank of the
group must hold equal, e.g. shapes, dtypes, options) and calls
``agree(where, group, spec)`` before its first collective. Coverage then follows from the
entry points themselves, not from hand-built dicts at each call site.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from .agreement import check_agreement

__all__ = ["AgreementSpec", "agree"]


@runtime_checkable
class AgreementSpec(Protocol):
    """A parsed, frozen argument set; ``fields()`` is what the ranks compare."""

    def fields(self) -> Mapping[str, object]: ...


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
    fields = spec.fields()
    if not isinstance(fields, Mapping):
        raise TypeError(f"{type(spec).__name__}.fields() must return a mapping, got {fields!r}")
    check_agreement(
        where, group, fields, identical=identical, device=device, error=error, always=always
    )
