"""Parse a ``--encoder``/``--llm`` layout flag, naming the flag in the error (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from mp_bridge.grid import AXIS_NAMES, GridLayout, parse_layout_spec

__all__ = ["layout_from_flag"]


def layout_from_flag(
    flag: str, spec: str, world: int, allowed: Sequence[str] = AXIS_NAMES
) -> GridLayout:
    """``parse_layout_spec(spec, world_size=world, allowed=allowed)``; a ``ValueError``
    starts with ``flag``. Axes in the order written (first = fastest over ranks)."""
    try:
        return parse_layout_spec(spec, world_size=world, allowed=allowed)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
