"""Parse layout specs such as ``"tp=2,cp=2,dp=2"`` into a :class:`GridLayout` (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from mp_bridge.checks import check_int
from mp_bridge.grid.layout import GridLayout

__all__ = ["AXIS_NAMES", "parse_layout_spec"]

#: Canonical axis names, fastest-varying first (megatron's default "tp-cp-pp-dp" order).
AXIS_NAMES: tuple[str, ...] = ("tp", "cp", "pp", "dp")


def parse_layout_spec(
    spec: str,
    *,
    world_size: int | None = None,
    allowed: Sequence[str] = AXIS_NAMES,
    rank_offset: int = 0,
) -> GridLayout:
    """``"tp=2,dp=4"`` -> ``GridLayout((2, 4), ("tp", "dp"))``.

    Axes appear in the order written (first = fastest over ranks); allowed axes not written
    are appended with size 1 in canonical order. With ``world_size`` (an int >= 1, checked
    first) the product must match.
    """
    if world_size is not None:
        check_int(
            "world_size", world_size, low=1,
            fix="pass the number of ranks the layout must cover (e.g. "
            "torch.distributed.get_world_size()), or world_size=None to skip the size check",
        )  # fmt: skip
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"layout spec {spec!r} is empty; write e.g. 'tp=2,dp=4'")
    names: list[str] = []
    sizes: list[int] = []
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"layout spec {spec!r}: '{part}' is not NAME=SIZE; write e.g. 'tp=2'")
        if key not in allowed:
            raise ValueError(
                f"layout spec {spec!r}: unknown axis '{key}'; valid axes are {list(allowed)}"
            )
        if key in names:
            raise ValueError(f"layout spec {spec!r}: axis '{key}' given twice; give it once")
        try:
            size = int(value)
        except ValueError:
            raise ValueError(
                f"layout spec {spec!r}: size '{value}' of '{key}' is not an integer"
            ) from None
        if size < 1:
            raise ValueError(f"layout spec {spec!r}: {key}={size} must be >= 1")
        names.append(key)
        sizes.append(size)
    for axis in allowed:
        if axis not in names:
            names.append(axis)
            sizes.append(1)
    layout = GridLayout(tuple(sizes), tuple(names), rank_offset)
    if world_size is not None and layout.size != world_size:
        raise ValueError(
            f"layout spec {spec!r} covers {layout.size} ranks but the world has {world_size}; "
            f"make the sizes multiply to {world_size}"
        )
    return layout
