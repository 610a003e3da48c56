"""Vocab sharding across tensor-parallel ranks (pure; Megatron-compatible layout).

Every TP rank holds ``V_local = ceil(vocab_size / (tp_size * multiple)) * multiple`` rows;
rank r owns ids ``[r * V_local, (r + 1) * V_local)``. The padded vocab ``V_local * tp_size``
may exceed ``vocab_size``; ids >= ``vocab_size`` are padding rows that never take part in
a softmax, loss, log-prob or entropy. This is megatron-core's padded layout
(``make_vocab_size_divisible_by`` = ``multiple``), so checkpoints interchange.

Example: ``vocab_shard_ranges(1001, 4) -> [(0, 251), (251, 502), (502, 753), (753, 1004)]``.
"""

from __future__ import annotations

__all__ = ["padded_vocab_size", "vocab_shard_ranges", "vocab_shard_size"]


def _check(vocab_size: int, tp_size: int, multiple: int) -> None:
    for name, value in (("vocab_size", vocab_size), ("tp_size", tp_size), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")


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
    local = vocab_shard_size(vocab_size, tp_size, multiple=multiple)
    return [(r * local, (r + 1) * local) for r in range(tp_size)]
