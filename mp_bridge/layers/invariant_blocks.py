"""Fixed vocab blocks as tensors: which blocks a rank holds, and the per-block fp32 math.

The numeric core of the TP-invariant losses (``invariant.py``, ``_fused_engine.py``):
``BlockLayout`` maps a rank's ``[V_local]`` shard onto the fixed ``VOCAB_BLOCK``-row blocks
of the global vocab; per (token tile, block) the fp32 partials ``[m, s, tl, sz]`` (block
max, sum of ``exp(z - m)``, target logit, sum of logits) are computed on fixed-shape
``[TOKEN_TILE, VOCAB_BLOCK]`` tiles, folded up the canonical tree (``vocab_blocks``), and
gathered across ranks (``gather_fold``: one all-gather of subtree partials, folded in the
same tree order on every rank). ``block_grad_`` turns a block's logits into
``d value / d logits`` in place. Every shape here depends only on the two constants, never
on the TP size, which is what makes the results bitwise TP-invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from mp_bridge.comm.primitives import all_gather_tensor, group_rank, group_size

from ._loss_common import LossSpec, check_vocab_size
from .vocab_blocks import (
    TOKEN_TILE,
    VOCAB_BLOCK,
    Piece,
    check_block_aligned,
    fold_tree,
    local_pieces,
    num_real_blocks,
)

__all__ = [
    "BlockLayout",
    "TargetSlots",
    "block_col",
    "block_grad_",
    "block_stats_",
    "combine_stats",
    "exp_shift_",
    "fold_blocks",
    "gather_fold",
    "pad_single_shard",
    "stats_values",
    "target_slots",
]


@dataclass(frozen=True)
class BlockLayout:
    """Which fixed vocab blocks this rank holds (pure).

    Example: vocab 1000, TP 2, shards of 512 rows: 4 real blocks; rank 1 holds local
    blocks 0, 1 = global blocks 2, 3 (block 3 has 1000 - 768 = 232 true ids: ``tail``).
    """

    vocab_size: int
    v_local: int
    tp_size: int
    rank: int
    block: int = VOCAB_BLOCK

    @property
    def num_real(self) -> int:
        return num_real_blocks(self.vocab_size, self.block)

    @property
    def first(self) -> int:
        """Global index of this rank's first block."""
        return self.rank * (self.v_local // self.block)

    @property
    def start(self) -> int:
        """First global id of this rank's shard."""
        return self.first * self.block

    @property
    def real_local_blocks(self) -> range:
        """Local block indices holding at least one true id."""
        return range(max(0, min(self.v_local // self.block, self.num_real - self.first)))

    @property
    def num_local(self) -> int:
        """``K``: real blocks on this rank (its padding blocks are never computed)."""
        return len(self.real_local_blocks)

    def valid(self, j: int) -> int:
        """True ids in local block ``j`` (``block``, except for the last real block)."""
        return min(self.block, self.vocab_size - (self.first + j) * self.block)

    @property
    def tail(self) -> int:
        """True ids in this rank's last real block (``block`` if full, 0 if none)."""
        return self.valid(self.num_local - 1) if self.num_local else 0

    def pieces(self, rank: int) -> list[Piece]:
        per = self.v_local // self.block
        return local_pieces(rank * per, (rank + 1) * per, self.num_real)

    @property
    def max_pieces(self) -> int:
        return max(len(self.pieces(r)) for r in range(self.tp_size))

    @classmethod
    def for_shard(
        cls, v_local: int, vocab_size: int | None, tp_group: dist.ProcessGroup | None
    ) -> BlockLayout:
        """Validate block alignment (before any collective) and describe this shard.

        At TP = 1 any width is accepted: the caller pads the one shard to whole blocks with
        ``pad_single_shard`` (padding rows are never computed), which is the layout every
        block-aligned TP size evaluates.
        """
        tp, rank = group_size(tp_group), group_rank(tp_group)
        vocab = check_vocab_size(vocab_size, v_local * tp, v_local, tp)
        if tp == 1:
            v_local = -(-v_local // VOCAB_BLOCK) * VOCAB_BLOCK
        check_block_aligned(v_local, rank * v_local, tp_size=tp)
        return cls(vocab, v_local, tp, rank)


def pad_single_shard(x: torch.Tensor, dim: int, layout: BlockLayout) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` to ``layout.v_local`` rows (TP = 1, unaligned vocab).

    A TP = 1 shard of any width (e.g. full ``[N, 1000]`` logits or a ``[1000, H]`` weight)
    is made block-aligned by one copy; the added ids are >= ``vocab_size`` (padding), and
    the gradient of ``F.pad`` slices them off. No-op when ``x`` already has the width.
    """
    missing = layout.v_local - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return torch.nn.functional.pad(x, pad)


# ------------------------------------------------------------- batched block numerics
# Logits live as one contiguous fp32 batch z [T, K, TOKEN_TILE, B] (tile, real local block,
# row, column). Every op on it is element-wise, a reduction over the last dim, or an
# indexed read/write of one element per row, so the bits of a row depend on that row
# alone, never on T or K (which vary with the chunk size and the TP size): ATen reduces
# each row whole with the same inner kernel whatever the number of rows (its threads split
# rows, never a row), and element-wise results do not depend on where a kernel's vector
# body ends (checked for exp, the only transcendental, with 1-3 threads on this build).


class TargetSlots(NamedTuple):
    """Where the targets this rank owns sit in a ``[T, K, TOKEN_TILE, B]`` batch."""

    pos: torch.Tensor  # flat token index (tile * TOKEN_TILE + row) of each owned target
    index: tuple[torch.Tensor, ...]  # (tile, block, row, col), one entry per owned target


def target_slots(target: torch.Tensor, layout: BlockLayout) -> TargetSlots:
    """Slots of ``target [T * TOKEN_TILE]`` (-1 on padded rows) in this rank's real blocks."""
    local = target - layout.start
    owned = (target >= 0) & (local >= 0) & (local < layout.num_local * layout.block)
    pos = owned.nonzero().squeeze(1)
    loc = local[pos]
    b = layout.block
    return TargetSlots(pos, (pos // TOKEN_TILE, loc // b, pos % TOKEN_TILE, loc % b))


def exp_shift_(z: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Mask the padding columns of ``z [T, K, TOKEN_TILE, B]`` to -inf, then ``z <- exp(z -
    m)`` in place, ``m [T, K, TOKEN_TILE]`` the max of each block row (returned)."""
    k = z.shape[1]
    if k and layout.tail < layout.block:
        z[:, k - 1, :, layout.tail :] = float("-inf")
    m = z.amax(dim=-1)
    z.sub_(m.unsqueeze(-1)).exp_()  # padding columns: exp(-inf) = 0
    return m


def block_stats_(
    z: torch.Tensor, layout: BlockLayout, slots: TargetSlots, with_sum: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[4, T, K, TOKEN_TILE]`` fp32 partials of every (tile, block) row, and ``m``.

    Partials: ``(max, sum exp(z - max), z[target] or 0, sum of the true z or 0)``. ``z``
    (raw fp32 logits) is left holding ``exp(z - m)`` (``exp_shift_``). With ``K == 0``
    the partials are all zero and are never folded (no pieces).
    """
    t, k = z.shape[:2]
    stats = z.new_zeros((4, t, k, TOKEN_TILE))
    if k == 0:
        return stats, stats[0]
    tile, blk, row, col = slots.index
    stats[2].index_put_((tile, blk, row), z[tile, blk, row, col])
    if with_sum:
        tail = layout.tail
        stats[3, :, : k - 1] = z[:, : k - 1].sum(dim=-1)
        stats[3, :, k - 1] = z[:, k - 1, :, :tail].sum(dim=-1)
    m = exp_shift_(z, layout)
    stats[0] = m
    stats[1] = z.sum(dim=-1)
    return stats, m


def combine_stats(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Online log-sum-exp merge of two ``[4, ...]`` partials (x left of y in vocab order)."""
    m = torch.maximum(x[0], y[0])
    # exp(-inf - m) = 0 keeps an all-padding partial (-inf, 0) an exact no-op.
    s = x[1] * torch.exp(x[0] - m) + y[1] * torch.exp(y[0] - m)
    return torch.stack([m, s, x[2] + y[2], x[3] + y[3]])


def stats_values(root: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, lse)`` per token from folded ``[4, ...]`` stats (affine form of LossSpec)."""
    a, b, c = spec.coefficients
    lse = root[0] + torch.log(root[1])
    value = lse * a + root[2] * b
    if c != 0.0:
        value = value + root[3] * c
    return value, lse


def block_grad_(
    e: torch.Tensor,
    m: torch.Tensor,
    lse: torch.Tensor,
    w: torch.Tensor,
    slots: TargetSlots,
    layout: BlockLayout,
    spec: LossSpec,
) -> torch.Tensor:
    """Turn ``e = exp(z - m) [T, K, TOKEN_TILE, B]`` into ``d value / d z`` in place.

    ``lse``, ``w``: ``[T, TOKEN_TILE]``; ``w`` is the per-token factor (upstream grad /
    temperature; 0 for ignored or padded rows). Result: ``w * (a * softmax + c)`` on true
    columns, plus ``w * b`` at the target; 0 on padding columns.
    """
    k = e.shape[1]
    if k == 0:
        return e
    a, b, c = spec.coefficients
    e.mul_(torch.exp(m - lse.unsqueeze(1)).unsqueeze(-1))  # softmax = exp(z - m) exp(m - lse)
    if a != 1.0:
        e.mul_(a)
    if c != 0.0:
        e.add_(c)
        if layout.tail < layout.block:
            e[:, k - 1, :, layout.tail :] = 0.0
    e.mul_(w.unsqueeze(1).unsqueeze(-1))
    if slots.pos.numel():
        e.index_put_(slots.index, e[slots.index] + w.reshape(-1)[slots.pos] * b)
    return e


def block_col(target: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Local column of each target inside ids ``[start, start + width)``, else -1."""
    inside = (target >= start) & (target < start + width)
    return torch.where(inside, target - start, -1)


# ------------------------------------------------------------- canonical-tree folds
def fold_blocks(
    values: torch.Tensor,
    dim: int,
    layout: BlockLayout,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[tuple[Piece, torch.Tensor]]:
    """This rank's maximal aligned subtrees (``layout.pieces``), each folded level by level.

    ``values``: local real block ``k`` at index ``k`` of ``dim``. A subtree of ``2**L``
    leaves takes ``L`` batched steps over the pairs ``(2i, 2i + 1)``: element by element
    the operations of the canonical tree (``combine`` must be element-wise).
    """
    out = []
    for level, idx in layout.pieces(layout.rank):
        v = values.narrow(dim, (idx << level) - layout.first, 1 << level)
        while v.shape[dim] > 1:
            pairs = v.unflatten(dim, (-1, 2))
            v = combine(pairs.select(dim + 1, 0), pairs.select(dim + 1, 1))
        out.append(((level, idx), v.squeeze(dim)))
    return out


def gather_fold(
    pieces: list[tuple[Piece, torch.Tensor]],
    layout: BlockLayout,
    tp_group: dist.ProcessGroup | None,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    """Root of the canonical tree from every rank's subtree partials (fp32, ``shape``).

    One all-gather of ``[P, *shape]`` over ``tp_group`` (none when TP = 1), ``P`` = the
    most pieces a rank holds; every rank then folds all pieces in the same tree order.
    """
    if layout.tp_size == 1:
        return fold_tree(dict(pieces), layout.num_real, combine)
    p_max, tp = layout.max_pieces, layout.tp_size
    packed = torch.zeros((p_max, *shape), dtype=torch.float32, device=device)
    for p, (_, value) in enumerate(pieces):
        packed[p] = value
    gathered = all_gather_tensor(packed, tp_group, 0).view(tp, p_max, *shape)
    owned = {piece: gathered[r, p] for r in range(tp) for p, piece in enumerate(layout.pieces(r))}
    return fold_tree(owned, layout.num_real, combine)


# ------------------------------------------------------------- materialized logits
