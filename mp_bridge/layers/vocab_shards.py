"""Vocab sharding across tensor-parallel ranks (pure; Megatron-compatible layout).

Every TP rank holds ``V_local = ceil(vocab_size / (tp_size * multiple)) * multiple`` rows;
rank r owns ids ``[r * V_local, (r + 1) * V_local)``. The padded vocab ``V_local * tp_size``
may exceed ``vocab_size``; ids >= ``vocab_size`` are padding rows that never take part in
a softmax, loss, log-prob or entropy. This is megatron-core's padded layout
(``make_vocab_size_divisible_by`` = ``multiple``), so checkpoints interchange.

Example: ``vocab_shard_ranges(1001, 4) -> [(0, 251), (251, 502), (502, 753), (753, 1004)]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.checks import check_int

__all__ = [
    "VocabShard",
    "padded_vocab_size",
    "vocab_shard_ranges",
    "vocab_shard_size",
    "vocab_shards",
]


def _check(vocab_size: int, tp_size: int, multiple: int) -> None:
    for name, value in (("vocab_size", vocab_size), ("tp_size", tp_size), ("multiple", multiple)):
        check_int(name, value, low=1)


def vocab_shard_size(vocab_size: int, tp_size: int, *, multiple: int = 1) -> int:
    """Rows per TP rank, ``V_local`` (a multiple of ``multiple``)."""
    _check(vocab_size, tp_size, multiple)
    step = tp_size * multiple
    return -(-vocab_size // step) * multiple


def padded_vocab_size(vocab_size: int, tp_size: int, *, multiple: int = 1) -> int:
    """``V_local * tp_size``: the vocab including padding rows."""
    return vocab_shard_size(vocab_size, tp_size, multiple=multiple) * tp_size


def vocab_shard_ranges(
    vocab_size: int, tp_size: int, *, multiple: int = 1
) -> list[tuple[int, int]]:
    """Per-rank ``(start, end)`` id ranges, each ``V_local`` rows long (end may pass the vocab)."""
    return [(s.start, s.stop) for s in vocab_shards(vocab_size, tp_size, multiple=multiple)]


@dataclass(frozen=True)
class VocabShard:
    """One TP rank's contiguous vocab rows ``[start, stop)`` of a ``padded_size`` vocab.

    The single place the shard offset ``rank * V_local`` is computed. ``vocab_size`` is
    the true vocab; rows at or past it are padding (``num_real`` counts the rest).
    Example: ``VocabShard.of_rank(4, 251, rank=3, vocab_size=1001)`` ->
    ``VocabShard(start=753, stop=1004, vocab_size=1001, padded_size=1004)``, ``num_real`` 248.
    """

    start: int
    stop: int
    vocab_size: int
    padded_size: int

    @property
    def size(self) -> int:
        """``V_local``: rows held, padding included."""
        return self.stop - self.start

    @property
    def num_real(self) -> int:
        """Rows of this shard below ``vocab_size`` (the rest are padding)."""
        return max(0, min(self.stop, self.vocab_size) - self.start)

    @classmethod
    def of_rank(
        cls, tp_size: int, v_local: int, *, rank: int, vocab_size: int | None = None
    ) -> VocabShard:
        """Rank ``rank``'s shard when every rank holds ``v_local`` rows (``None``: no padding)."""
        padded = tp_size * v_local
        return cls(
            rank * v_local,
            (rank + 1) * v_local,
            padded if vocab_size is None else vocab_size,
            padded,
        )


def vocab_shards(vocab_size: int, tp_size: int, *, multiple: int = 1) -> list[VocabShard]:
    """Every rank's :class:`VocabShard`, in rank order (Megatron's padded layout)."""
    local = vocab_shard_size(vocab_size, tp_size, multiple=multiple)
    return [
        VocabShard.of_rank(tp_size, local, rank=r, vocab_size=vocab_size) for r in range(tp_size)
    ]
