"""Load-balanced context-parallel token indices (pure: no process group, no collectives).

Causal attention costs more for late tokens than for early ones, so a sequence of length
``S`` is cut into ``2·cp`` equal chunks and CP rank ``i`` keeps chunks ``i`` and
``2·cp−1−i``, in that order: every rank then does the same number of (query, key ≤ query)
pairs. Packed (THD) batches apply the same cut to each sequence separately. With
``cp = 1`` there is nothing to balance: rank 0 keeps every token, and any length works.

Example, ``S = 8``, ``cp = 2`` (chunks of 2)::

    rank 0 -> [0, 1, 6, 7]
    rank 1 -> [2, 3, 4, 5]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_bridge.checks import as_int, check_bool, check_int
from mp_bridge.deprecations import warn_deprecated

_COMPLEX = (torch.complex64, torch.complex128)

__all__ = [
    "cp_factor",
    "cp_gather_order",
    "cp_shard_indices",
    "cp_shard_indices_packed",
    "gather_order_of_bounds",
    "normalize_cu_seqlens",
    "seq_len_divisor",
    "shard_indices_of_bounds",
]


def _check_cp(cp_size: object, cp_rank: object) -> tuple[int, int]:
    cp = check_int("cp_size", cp_size, low=1)
    rank = check_int("cp_rank", cp_rank, low=0)
    if rank >= cp:
        raise ValueError(f"cp_rank={rank} is out of range for cp_size={cp}; use 0..{cp - 1}")
    return cp, rank


def seq_len_divisor(cp_size: int, tp_size: int = 1, *, sequence_parallel: bool = False) -> int:
    """What every (per-sequence) length must be divisible by: the one formula.

    ``2·cp`` for the load-balanced CP cut (1 when ``cp == 1``: no split, any length),
    times ``tp`` with sequence parallelism (the tokens are then also split over TP).
    ``seq_len_divisor(1) == 1``, ``seq_len_divisor(4) == 8``,
    ``seq_len_divisor(2, 3, sequence_parallel=True) == 12``,
    ``seq_len_divisor(1, 3, sequence_parallel=True) == 3``.
    """
    cp = check_int("cp_size", cp_size, low=1)
    tp = check_int("tp_size", tp_size, low=1)
    check_bool("sequence_parallel", sequence_parallel)
    return (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)


def cp_factor(cp_size: int) -> int:
    """Deprecated: ``seq_len_divisor(cp_size)`` (``DeprecationWarning``)."""
    warn_deprecated("mp_bridge.comm.cp_factor")
    return seq_len_divisor(cp_size)


def normalize_cu_seqlens(
    cu_seqlens: Sequence[int] | torch.Tensor, factor: int, *, total: int | None = None
) -> list[int]:
    """Validate cumulative sequence lengths and return them as a list of ints.

    ``cu_seqlens`` is ``[0, l0, l0+l1, ...]`` (1-D, non-decreasing, starting at 0); every
    length must be divisible by ``factor`` (``seq_len_divisor(cp)``) and, if given, the
    last entry must equal ``total`` (the packed token count). Entries may be Python or
    NumPy ints, or a 1-D integer tensor. Raises ``ValueError``/``TypeError``.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        dtype = cu_seqlens.dtype
        if cu_seqlens.dim() != 1 or dtype.is_floating_point or dtype in (torch.bool,) + _COMPLEX:
            raise TypeError(
                f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)} "
                f"dtype {cu_seqlens.dtype}; e.g. torch.tensor([0, 8, 24])"
            )
        values = [int(v) for v in cu_seqlens.tolist()]
    elif isinstance(cu_seqlens, bool) or not hasattr(cu_seqlens, "__iter__"):
        raise TypeError(
            f"cu_seqlens must be a 1-D integer tensor or a list of ints, got "
            f"{type(cu_seqlens).__name__} {cu_seqlens!r}; e.g. [0, 8, 24] for lengths 8 and 16"
        )
    else:
        values = list(cu_seqlens)
        ints = [as_int(v) for v in values]  # ints, NumPy ints; not bools
        if None in ints:
            raise TypeError(f"cu_seqlens must hold ints, got {values!r}; e.g. [0, 8, 24]")
        values = ints
    if len(values) < 2 or values[0] != 0:
        raise ValueError(
            f"cu_seqlens={values} must start at 0 and hold at least one sequence, "
            "e.g. [0, 8, 24] for lengths 8 and 16"
        )
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens={values} must be non-decreasing (lengths {lengths})")
    bad = [n for n in lengths if n % factor]
    if bad:
        raise ValueError(
            f"packed sequence lengths {lengths} (cu_seqlens={values}) must each be divisible "
            f"by 2·cp={factor}; lengths {bad} are not: pad each sequence to a multiple of {factor}"
        )
    if total is not None and values[-1] != total:
        raise ValueError(
            f"cu_seqlens[-1]={values[-1]} must equal the packed sequence length {total}"
        )
    return values


def cp_shard_indices(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Indices (LongTensor ``[seq_len // cp_size]``) of the tokens CP rank ``cp_rank`` keeps.

    Chunks ``cp_rank`` and ``2·cp_size−1−cp_rank`` of ``2·cp_size`` equal chunks, in that
    order. ``S=16, cp=4``: rank 0 -> [0, 1, 14, 15], rank 1 -> [2, 3, 12, 13], ...
    ``seq_len`` must be divisible by ``2·cp_size`` (``ValueError`` with the factor otherwise);
    ``cp_size=1`` keeps ``arange(seq_len)`` for any length.
    """
    cp, rank = _check_cp(cp_size, cp_rank)
    seq_len = check_int("seq_len", seq_len, low=0)
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2·cp={2 * cp} (cp_size={cp}); "
            f"pad the sequence to a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * cp - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)
    return torch.cat([first, second])


def cp_shard_indices_packed(
    cu_seqlens: Sequence[int] | torch.Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`cp_shard_indices` applied to each sequence of a packed (THD) batch.

    ``cu_seqlens`` = ``[0, l0, l0+l1, ...]`` (global, over the full packed length); each
    length must be divisible by ``2·cp_size`` (any length when ``cp_size=1``). Returns
    indices into the packed token dim, sequence by sequence; the local cumulative lengths
    are ``cu_seqlens // cp_size``.
    ``cu_seqlens=[0, 4, 12], cp=2``: rank 0 -> [0, 3, 4, 5, 10, 11], rank 1 -> [1, 2, 6, 7, 8, 9].
    """
    cp, rank = _check_cp(cp_size, cp_rank)
    bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(cp))
    return shard_indices_of_bounds(bounds, cp, rank, device=device)


def shard_indices_of_bounds(
    bounds: Sequence[int], cp: int, rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """:func:`cp_shard_indices_packed` of bounds parsed already (a ``PaddedLayout``'s):
    no second parse of the same lengths."""
    parts = [
        start + cp_shard_indices(end - start, cp, rank, device=device)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts)


def gather_order_of_bounds(
    bounds: Sequence[int], cp: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """:func:`cp_gather_order` of packed bounds parsed already (a ``PaddedLayout``'s)."""
    return torch.cat([shard_indices_of_bounds(bounds, cp, r, device=device) for r in range(cp)])


def cp_gather_order(
    seq_len: int,
    cp_size: int,
    *,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global index of each token after an all-gather of the CP shards in rank order.

    ``cat([idx(rank 0), idx(rank 1), ...])``, a permutation of ``range(seq_len)``;
    ``gathered.index_select(d, cp_gather_order(...).argsort())`` restores sequence order.
    ``S=8, cp=2`` -> [0, 1, 6, 7, 2, 3, 4, 5].
    """
    cp = check_int("cp_size", cp_size, low=1)
    if cu_seqlens is None:
        parts = [cp_shard_indices(seq_len, cp, r, device=device) for r in range(cp)]
    else:
        bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(cp), total=seq_len)
        return gather_order_of_bounds(bounds, cp, device=device)
    return torch.cat(parts)
