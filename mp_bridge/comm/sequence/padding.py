"""Pad sequences of any length to the CP/SP cut, and undo it (pure: no process group).

The load-balanced CP cut (:mod:`mp_bridge.comm.sequence.cut`) needs every (per-document)
length divisible by ``2·cp`` and, with sequence parallelism, the sequence (the packed
total) divisible by ``2·cp·tp``. :func:`pad_layout` describes the smallest padded layout
that satisfies it; the padding tokens sit **at the end** of each sequence / document, so
the original tokens keep their order:

- plain ``[b, S]``: every row is padded from ``S`` to ``ceil(S / f)·f`` with
  ``f = seq_len_divisor(cp, tp, sequence_parallel=sp)``: at most ``f − 1`` tokens per row.
- packed (``cu_seqlens``): every document of length ``L`` is padded to
  ``ceil(L / (2·cp))·2·cp`` (at most ``2·cp − 1`` tokens per document, ``cp − ½`` on
  average); with SP a last padding-only document of fewer than ``2·cp·tp`` tokens (a
  multiple of ``2·cp``) completes the total. ``cp = 1`` without SP never pads.

Example, ``cp = 2``, ``cu_seqlens = [0, 3, 8]``: documents 3 and 5 become 4 and 8,
``padded_bounds == (0, 4, 12)``, and ``source_index() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1,
-1, -1]`` (``-1`` marks padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mp_bridge.comm.sequence.cut import (
    cp_shard_indices,
    normalize_cu_seqlens,
    seq_len_divisor,
    shard_indices_of_bounds,
)

__all__ = ["PaddedLayout", "original_layout", "pad_along", "pad_layout"]


def _round_up(n: int, f: int) -> int:
    return -(-n // f) * f


@dataclass(frozen=True)
class PaddedLayout:
    """A sequence layout before and after padding to the CP/SP cut.

    - ``seq_len`` / ``padded_len``: tokens per row (plain) or packed total, before / after.
    - ``bounds`` / ``padded_bounds``: cumulative document lengths before / after (packed),
      else ``None``. ``padded_bounds`` may end with one padding-only document (SP).
    - ``cp``, ``pieces``: CP size and SP pieces per CP shard (``tp`` with SP, else 1).

    The parsed form of a (packed) batch: built once per step by ``PartitionAdapter.shard``
    (``ShardedBatch.layout``) and passed to ``route``, ``context_parallel_attention`` and
    :func:`~mp_bridge.comm.sequence.mask.packed_sequence_mask`, which then trust it. Masks
    derived from it are cached on it (every attention layer of a step reuses one).
    """

    seq_len: int
    padded_len: int
    bounds: tuple[int, ...] | None
    padded_bounds: tuple[int, ...] | None
    cp: int
    pieces: int
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def packed(self) -> bool:
        """Whether the layout holds packed documents (``cu_seqlens`` given)."""
        return self.bounds is not None

    @classmethod
    def of_documents(cls, bounds: Sequence[int], cp: int = 1) -> PaddedLayout:
        """The layout of packed documents whose ``bounds`` are parsed already
        (:func:`~mp_bridge.comm.sequence.cut.normalize_cu_seqlens`): no padding, cut for
        ``cp``. ``cp = 1`` is a batch's documents as given at the door, which
        :func:`pad_layout` (``PartitionAdapter.shard(cu_seqlens=...)``) pads without
        parsing them again; ``of_documents([0, 3, 8]).padded_len == 8``."""
        bounds = tuple(bounds)
        return cls(bounds[-1], bounds[-1], bounds, bounds, cp, 1)

    def cached(self, key: object, make):
        """``make()`` once per ``key`` for this layout (derived tensors reused by layers)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def padding(self) -> int:
        """Padding tokens per row (plain) or in the packed sequence."""
        return self.padded_len - self.seq_len

    def source_index(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor ``[padded_len]``: the original index of each padded position, ``-1``
        for padding."""
        if self.bounds is None:
            src = torch.full((self.padded_len,), -1, dtype=torch.long, device=device)
            src[: self.seq_len] = torch.arange(self.seq_len, device=device)
            return src
        src = torch.full((self.padded_len,), -1, dtype=torch.long, device=device)
        for a, b, pa in zip(self.bounds[:-1], self.bounds[1:], self.padded_bounds):
            src[pa : pa + b - a] = torch.arange(a, b, device=device)
        return src

    def kept_positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor ``[seq_len]``: the padded position of each original token, in order."""
        return torch.nonzero(self.source_index(device) >= 0).reshape(-1)

    def local_positions(
        self, cp_rank: int, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Padded positions CP rank ``cp_rank`` keeps, in its local order (the CP cut)."""
        if self.padded_bounds is None:
            return cp_shard_indices(self.padded_len, self.cp, cp_rank, device=device)
        return shard_indices_of_bounds(self.padded_bounds, self.cp, cp_rank, device=device)

    def shard_of_position(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor ``[padded_len]``: the shard ``cp_rank·pieces + piece`` holding each
        padded position (``piece``: the SP piece of the CP-local sequence, 0 without SP)."""
        shard = torch.empty(self.padded_len, dtype=torch.long, device=device)
        local_len = self.padded_len // self.cp
        piece = torch.arange(local_len, device=device) // max(local_len // self.pieces, 1)
        for c in range(self.cp):
            shard[self.local_positions(c, device)] = c * self.pieces + piece
        return shard


def pad_layout(
    seq_len: int,
    cp_size: int,
    tp_size: int = 1,
    *,
    sequence_parallel: bool = False,
    cu_seqlens: PaddedLayout | Sequence[int] | torch.Tensor | None = None,
) -> PaddedLayout:
    """The padded layout of a sequence of ``seq_len`` tokens (see the module docstring).

    ``cu_seqlens``: the packed documents' cumulative lengths (any lengths; the last entry
    must equal ``seq_len``), or a packed :class:`PaddedLayout` whose original ``bounds``
    are used as parsed (:meth:`PaddedLayout.of_documents`). ``sequence_parallel`` with
    ``tp_size > 1`` also makes the padded (total) length a multiple of ``tp`` pieces per
    CP shard.
    """
    sp = sequence_parallel and tp_size > 1
    pieces = tp_size if sp else 1
    total_factor = seq_len_divisor(cp_size, tp_size, sequence_parallel=sp)
    if cu_seqlens is None:
        padded = _round_up(seq_len, total_factor)
        return PaddedLayout(seq_len, padded, None, None, cp_size, pieces)
    if isinstance(cu_seqlens, PaddedLayout):  # parsed already: its original documents
        if not cu_seqlens.packed or cu_seqlens.seq_len != seq_len:
            raise ValueError(
                f"{cu_seqlens!r} is not a packed layout of {seq_len} tokens; pass the "
                f"documents of this batch (PaddedLayout.of_documents) or cu_seqlens"
            )
        bounds = list(cu_seqlens.bounds)
    else:
        bounds = normalize_cu_seqlens(cu_seqlens, 1, total=seq_len)
    doc_factor = seq_len_divisor(cp_size)
    padded_bounds = [0]
    for a, b in zip(bounds[:-1], bounds[1:]):
        padded_bounds.append(padded_bounds[-1] + _round_up(b - a, doc_factor))
    tail = _round_up(padded_bounds[-1], total_factor) - padded_bounds[-1]
    if tail:  # a multiple of doc_factor, as both totals are
        padded_bounds.append(padded_bounds[-1] + tail)
    return PaddedLayout(
        seq_len, padded_bounds[-1], tuple(bounds), tuple(padded_bounds), cp_size, pieces
    )


def pad_along(t: torch.Tensor, dim: int, src: torch.Tensor, fill: object) -> torch.Tensor:
    """``t`` laid out along ``dim`` by ``src`` (padded position -> original index, ``-1``
    for padding), padding filled with ``fill``; ``fill=None`` (positions) continues each
    padding run after the last real token: ``p + 1, p + 2, ...``."""
    src = src.to(t.device)
    real = src >= 0
    shape = [1] * t.dim()
    shape[dim] = src.numel()
    if fill is None:
        ar = torch.arange(src.numel(), device=t.device)
        last = torch.where(real, ar, -1).cummax(0).values.clamp(min=0)
        base = t.index_select(dim, src[last].clamp(min=0))
        return base + (ar - last).reshape(shape).to(t.dtype)
    gathered = t.index_select(dim, src.clamp(min=0))
    filler = torch.tensor(fill, dtype=t.dtype, device=t.device)
    return torch.where(real.reshape(shape), gathered, filler)


def original_layout(
    full_len: int,
    seq_len: int | None,
    cu_seqlens: Sequence[int] | torch.Tensor | None,
    cp_size: int,
    tp_size: int,
    sequence_parallel: bool,
) -> PaddedLayout:
    """The layout ``shard`` padded the original sequence (``seq_len`` tokens, or the packed
    ``cu_seqlens``) to; ``ValueError`` unless it is ``full_len`` tokens (``unshard``)."""
    if cu_seqlens is not None:
        cu_seqlens = normalize_cu_seqlens(cu_seqlens, 1)
        total = cu_seqlens[-1]
        if seq_len is not None and seq_len != total:
            raise ValueError(f"seq_len={seq_len} but cu_seqlens ends at {total}; pass one")
        seq_len = total
    layout = pad_layout(
        seq_len, cp_size, tp_size, sequence_parallel=sequence_parallel, cu_seqlens=cu_seqlens
    )
    if layout.padded_len != full_len:
        what = "cu_seqlens" if cu_seqlens is not None else f"seq_len={seq_len}"
        raise ValueError(
            f"{what} pads to {layout.padded_len} tokens but the gathered sequence has "
            f"{full_len}; pass the original seq_len / cu_seqlens given to shard()"
        )
    return layout
