"""Pure rank geometry of a megatron-core ``HyperCommGrid`` (no ``torch.distributed``).

Vocabulary: an *axis* is a grid axis (``"tp"``, ``"cp"``, ...), a *dim* a tensor
dimension. megatron-core's ``HyperCommGrid`` calls the axis names ``dim_names``; a
layout calls them ``axis_names`` (``dim_names`` is a deprecated alias). Convention (the one
``HyperCommGrid`` uses): the first axis name varies fastest over rank ids, so for
``shape=(TP, CP, DP)`` and ``axis_names=("tp", "cp", "dp")``::

    rank = rank_offset + tp + TP * (cp + CP * dp)

Example, ``GridLayout((2, 2, 2), ("tp", "cp", "dp"))``:
    ``coords(5) -> {"tp": 1, "cp": 0, "dp": 1}``,
    ``groups("tp") -> [[0, 1], [2, 3], [4, 5], [6, 7]]``,
    ``groups("cp") -> [[0, 2], [1, 3], [4, 6], [5, 7]]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mp_bridge.checks import as_int
from mp_bridge.deprecations import resolve_alias, warn_deprecated

__all__ = ["GridLayout"]


def _as_axis_list(axes: str | Sequence[str]) -> list[str]:
    if isinstance(axes, str):
        return [axes]
    return list(axes)


@dataclass(frozen=True, init=False)
class GridLayout:
    """A frozen description of an N-d rank grid: ``shape``, ``axis_names``, ``rank_offset``.

    ``shape[i]`` is the size of axis ``axis_names[i]``. ``dim_names=`` (megatron's
    spelling) is accepted in place of ``axis_names`` with a ``DeprecationWarning``.

    Mirrors ``megatron.core.hyper_comm_grid.HyperCommGrid`` exactly (rank enumeration and
    group member order) but needs no process group, so plans can be unit-tested on CPU.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    rank_offset: int = 0

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
        rank_offset: int = 0,
        *,
        dim_names: Sequence[str] | None = None,
    ) -> None:
        axis_names = resolve_alias(
            "mp_bridge.grid.GridLayout(dim_names=...)", "axis_names", axis_names, "dim_names",
            dim_names, both="pass axis_names= (or its deprecated alias dim_names=), not both",
        )  # fmt: skip
        if axis_names is None:
            raise TypeError("GridLayout needs axis_names, e.g. GridLayout((2, 4), ('tp', 'dp'))")
        shape = tuple(shape)
        names = tuple(axis_names)
        for size in shape:
            if as_int(size) is None:
                raise TypeError(f"shape entries must be ints, got {size!r} in shape={shape}")
        shape = tuple(as_int(size) for size in shape)  # NumPy ints -> int
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"axis_names entries must be non-empty strings, got {name!r} in {names}"
                )
        if len(shape) != len(names):
            raise ValueError(
                f"shape={shape} has {len(shape)} entries but axis_names={names} has "
                f"{len(names)}; give one size per name"
            )
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"axis_names={names} repeats {dupes}; every axis name must be unique")
        bad = [s for s in shape if s <= 0]
        if bad:
            raise ValueError(f"shape={shape} has non-positive sizes {bad}; every size must be >= 1")
        offset = as_int(rank_offset)
        if offset is None:
            raise TypeError(f"rank_offset must be an int, got {rank_offset!r}")
        if offset < 0:
            raise ValueError(f"rank_offset={offset} is negative; use 0 or a positive rank")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "rank_offset", offset)

    # ------------------------------------------------------------------ basics
    @classmethod
    def from_grid(cls, grid: Any) -> GridLayout:
        """The layout of a megatron-core ``HyperCommGrid`` (reads shape, names, offset)."""
        try:
            names = grid.axis_names if isinstance(grid, GridLayout) else grid.dim_names
            shape, offset = grid.shape, grid.rank_offset
        except AttributeError as exc:
            raise TypeError(
                f"from_grid expects a HyperCommGrid (with shape, dim_names, rank_offset), "
                f"got {type(grid).__name__}"
            ) from exc
        return cls(tuple(int(s) for s in shape), tuple(names), int(offset))

    @property
    def size(self) -> int:
        """Number of ranks the grid covers."""
        return math.prod(self.shape)

    @property
    def ranks(self) -> range:
        """The global ranks of the grid, ``range(rank_offset, rank_offset + size)``."""
        return range(self.rank_offset, self.rank_offset + self.size)

    @property
    def dim_names(self) -> tuple[str, ...]:
        """Deprecated alias of :attr:`axis_names` (megatron's spelling)."""
        warn_deprecated("mp_bridge.grid.GridLayout.dim_names")
        return self.axis_names

    def axis_size(self, name: str) -> int:
        """Size of axis ``name``; 1 when the grid has no such axis."""
        if name in self.axis_names:
            return self.shape[self.axis_names.index(name)]
        return 1

    def dim(self, name: str) -> int:
        """Deprecated alias of :meth:`axis_size`."""
        warn_deprecated("mp_bridge.grid.GridLayout.dim")
        return self.axis_size(name)

    def __contains__(self, rank: object) -> bool:
        value = as_int(rank)
        return value is not None and value in self.ranks

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape))
        off = f", offset={self.rank_offset}" if self.rank_offset else ""
        return f"GridLayout({axes}{off})"

    # ------------------------------------------------------------ coordinates
    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of a global ``rank``, e.g. ``{"tp": 1, "cp": 0, "dp": 1}``."""
        if as_int(rank) is None:
            raise TypeError(f"rank must be an int, got {rank!r}")
        rank = as_int(rank)
        if rank not in self.ranks:
            raise ValueError(
                f"rank={rank} is outside {self!r}, which covers ranks "
                f"[{self.ranks.start}, {self.ranks.stop}); pass a rank in that range"
            )
        local = rank - self.rank_offset
        out: dict[str, int] = {}
        for name, size in zip(self.axis_names, self.shape):
            out[name] = local % size
            local //= size
        return out

    def rank(self, **coords: int) -> int:
        """Global rank at ``coords``; axes not given must have size 1 (coordinate 0).

        Names the grid lacks are accepted with coordinate 0 (such an axis has size 1).
        """
        for name, value in coords.items():
            size = self.axis_size(name)
            if as_int(value) is None:
                raise TypeError(f"coordinate {name}={value!r} must be an int")
            if not 0 <= value < size:
                raise ValueError(
                    f"coordinate {name}={value} is out of range for {self!r}; "
                    f"use 0 <= {name} < {size}"
                )
        missing = [n for n, s in zip(self.axis_names, self.shape) if s > 1 and n not in coords]
        if missing:
            raise ValueError(
                f"rank() needs a coordinate for every axis of size > 1; missing {missing} "
                f"for {self!r}"
            )
        local, stride = 0, 1
        for name, size in zip(self.axis_names, self.shape):
            local += as_int(coords.get(name, 0)) * stride
            stride *= size
        return self.rank_offset + local

    # ----------------------------------------------------------------- groups
    def _check_axes(self, axes: str | Sequence[str], arg: str = "axes") -> list[str]:
        names = _as_axis_list(axes)
        if not names:
            raise ValueError(f"{arg} is empty; name at least one of {list(self.axis_names)}")
        unknown = [d for d in names if d not in self.axis_names]
        if unknown:
            raise ValueError(
                f"unknown axis name(s) {unknown} for {self!r}; valid names are "
                f"{list(self.axis_names)}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"{arg}={names} repeats an axis name; name each axis once")
        return names

    def groups(self, dims: str | Sequence[str]) -> list[list[int]]:
        """Rank groups spanning the axes ``dims`` (one axis name or several; the parameter
        keeps megatron's name): identical to ``HyperCommGrid.get_rank_enum(dims)``.

        Groups are ordered by the remaining axes (slowest first); members by the grouped
        axes, the first-named (fastest) axis varying fastest — i.e. ascending rank.
        """
        wanted = set(self._check_axes(dims, "dims"))
        reverse = list(reversed(self.axis_names))  # slowest axis first, as megatron orders
        grouped = [d for d in reverse if d in wanted]
        remaining = [d for d in reverse if d not in wanted]
        strides = {}
        stride = 1
        for name, size in zip(self.axis_names, self.shape):
            strides[name] = stride
            stride *= size

        def enumerate_axes(axes: list[str]) -> list[int]:
            # Row-major offsets over `axes` (first listed varies slowest).
            offsets = [0]
            for axis in axes:
                offsets = [
                    o + i * strides[axis] for o in offsets for i in range(self.axis_size(axis))
                ]
            return offsets

        members = enumerate_axes(grouped)
        return [
            [self.rank_offset + base + m for m in members] for base in enumerate_axes(remaining)
        ]

    def group_of(self, rank: int, dims: str | Sequence[str]) -> list[int]:
        """The member list of the group spanning axes ``dims`` that contains ``rank``."""
        self.coords(rank)  # validates the rank
        for group in self.groups(dims):
            if rank in group:
                return group
        raise AssertionError("unreachable: every rank of the grid is in one group")
