"""The canonical reduction tree over vocab blocks (pure Python, no tensors).

Leaves are the ``K`` real vocab blocks (``blocks``). Canonical tree: a perfect binary
tree over leaves ``0 .. 2**D - 1`` (``D = ceil(log2 K)``); node ``(level, idx)`` covers
leaves ``[idx * 2**level, (idx + 1) * 2**level)``; a node whose range starts at or past
``K`` is the identity, and ``combine(x, identity) = x``. The value of the root is
therefore one fixed expression of the K block values.

A rank that owns blocks ``[lo, hi)`` (any block-aligned shard) folds them into the
*maximal aligned subtrees* inside ``[lo, min(hi, K))`` (``local_pieces``); when its shard
is a power-of-two number of blocks at an aligned offset that is one whole subtree. The
pieces of all ranks are gathered and every rank evaluates the same tree on them
(``fold_tree``). Every TP size whose shards are block-aligned therefore computes the same
expression, operation for operation, as TP = 1 (e.g. K = 10: TP = 1 folds
``[0,8) + [8,10)``; TP = 2 owns ``[0,5)`` -> pieces ``[0,4), [4]`` and ``[5,10)`` ->
``[5], [6,8), [8,10)``, and the tree rebuilds ``[4,6)``, ``[4,8)`` and ``[0,8)`` from them).

Example: ``local_pieces(3, 9, 8) == [(0, 3), (2, 1)]`` (leaf 3, then the subtree [4, 8)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = [
    "Piece",
    "StreamFold",
    "fold_tree",
    "local_pieces",
    "max_pieces",
    "stream_fold",
    "tree_depth",
]

Piece = tuple[int, int]  # (level, idx): tree node covering [idx * 2**level, (idx+1) * 2**level)
T = TypeVar("T")


def tree_depth(num_real: int) -> int:
    """``D``: levels above the leaves (``2**D >= num_real``)."""
    return max(num_real - 1, 0).bit_length()


def local_pieces(lo: int, hi: int, num_real: int) -> list[Piece]:
    """Maximal aligned subtrees covering real blocks ``[lo, min(hi, num_real))``, in order."""
    return [
        piece for piece, _ in stream_fold(((j, j) for j in range(lo, min(hi, num_real))), _first)
    ]


def max_pieces(local_blocks: int, tp_size: int, num_real: int) -> int:
    """Most pieces any rank of a ``tp_size`` layout with ``local_blocks`` blocks holds."""
    return max(
        len(local_pieces(r * local_blocks, (r + 1) * local_blocks, num_real))
        for r in range(tp_size)
    )


def _first(a: T, b: T) -> T:
    return a


class StreamFold:
    """Incremental ``stream_fold``: ``push`` consecutive leaves; ``stack`` holds the
    ``(piece, value)`` nodes folded so far (bottom first). A merge keeps the left node's
    position and value object (``combine`` may work in place), so a caller can move the
    values of ``stack`` into storage of its own between pushes."""

    def __init__(self, combine: Callable[[T, T], T]) -> None:
        self.combine = combine
        self.stack: list[tuple[Piece, T]] = []

    def push(self, j: int, value: T) -> None:
        stack = self.stack
        if stack and _end(stack[-1][0]) != j:
            raise ValueError(f"leaves must be consecutive; got {j} after {stack[-1][0]}")
        node: tuple[Piece, T] = ((0, j), value)
        while stack and _siblings(stack[-1][0], node[0]):
            (level, idx), left = stack.pop()
            node = ((level + 1, idx // 2), self.combine(left, node[1]))
        stack.append(node)


def stream_fold(
    leaves: Iterable[tuple[int, T]], combine: Callable[[T, T], T]
) -> list[tuple[Piece, T]]:
    """Fold consecutive ``(leaf index, value)`` pairs into maximal aligned subtrees.

    Merges two stack tops exactly when they are siblings, so peak storage is
    O(log #leaves) values and the operations are those of the canonical tree.
    """
    fold = StreamFold(combine)
    for j, value in leaves:
        fold.push(j, value)
    return fold.stack


def _end(piece: Piece) -> int:
    level, idx = piece
    return (idx + 1) << level


def _siblings(left: Piece, right: Piece) -> bool:
    return left[0] == right[0] and left[1] % 2 == 0 and right[1] == left[1] + 1


def fold_tree(pieces: dict[Piece, T], num_real: int, combine: Callable[[T, T], T]) -> T:
    """Root of the canonical tree over ``num_real`` leaves, given a disjoint cover by pieces.

    Identity subtrees (start >= ``num_real``) are skipped, never combined. Raises
    ``ValueError`` if some real leaf is not covered.
    """
    root = _node(pieces, num_real, combine, tree_depth(num_real), 0)
    if root is None:
        raise ValueError(f"num_real={num_real} must be >= 1")
    return root


def _node(
    pieces: dict[Piece, T], num_real: int, combine: Callable[[T, T], T], level: int, idx: int
) -> T | None:
    # A module-level function, not a recursive closure: a closure that refers to itself is
    # a reference cycle, which would keep ``pieces`` (gathered tensors) alive until the
    # garbage collector runs.
    if (level, idx) in pieces:
        return pieces[(level, idx)]
    if idx << level >= num_real:
        return None
    if level == 0:
        raise ValueError(f"leaf {idx} is not covered by the pieces {sorted(pieces)}")
    left = _node(pieces, num_real, combine, level - 1, 2 * idx)
    right = _node(pieces, num_real, combine, level - 1, 2 * idx + 1)
    if right is None:
        return left
    assert left is not None  # a right subtree with real leaves has a real left sibling
    return combine(left, right)
