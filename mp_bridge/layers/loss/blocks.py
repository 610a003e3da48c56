"""Fixed vocab blocks and token tiles: the geometry of TP-invariant losses (no collectives).

The padded vocab is cut into blocks of ``VOCAB_BLOCK`` rows that do not depend on the TP
size: block ``j`` holds global ids ``[j * VOCAB_BLOCK, (j + 1) * VOCAB_BLOCK)``. Only the
``K = ceil(vocab_size / VOCAB_BLOCK)`` *real* blocks (those holding at least one true id)
take part; padding blocks are the identity of every fold, by construction (they are never
computed, so they cannot perturb a single bit). Tokens are cut into tiles of
``TOKEN_TILE`` rows, and every matmul is one tile against a group of ``BLOCK_GROUP`` blocks
(``block_groups``) with the hidden dim padded to ``HIDDEN_ALIGN``: the same shapes and batch
count whatever the chunk size, the token count or the TP size.

Why this is TP-invariant: a shard laid out with ``vocab_shard_ranges(vocab_size, tp,
multiple=VOCAB_BLOCK)`` (megatron: ``make_vocab_size_divisible_by=256``) holds whole
blocks at every TP size, and any run of whole blocks splits into whole subtrees of one
canonical tree (``tree``); each rank folds its subtrees, the subtree results are
gathered and every rank folds them in the same tree order (``reduce.gather_fold``),
which is the expression TP = 1 evaluates. At TP = 1 a shard of any width is zero-padded
to whole blocks by one copy (``pad_single_shard``), giving the same bits. A shard that is
not block-aligned cannot give the same expression and is rejected before any collective.
TP = 1, 2, 3, 4, 8, ... alike (the tests run 1, 2, 3, 4 and 8; the acceptance tests 5, 6).
Bits are identical for a given machine, torch/BLAS build and intra-op thread count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mp_bridge.layers.loss.tree import Piece, local_pieces, max_pieces
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = [
    "BLOCK_GROUP",
    "HIDDEN_ALIGN",
    "TOKEN_TILE",
    "VOCAB_BLOCK",
    "WEIGHT_GRAD_ROWS",
    "BlockGroup",
    "BlockLayout",
    "TargetSlots",
    "block_groups",
    "check_block_aligned",
    "fold_blocks",
    "num_real_blocks",
    "pad_single_shard",
    "shard_columns",
    "target_slots",
]

#: Vocab rows per block (invariant mode). 256 keeps the padding of usual vocabularies
#: small (at most 255 ids per TP rank) and the leaves of the tree few enough that the
#: fold is cheap; block math runs batched over all (tile, block) pairs of a chunk, each
#: row's bits independent of the batch (see ``formulas``).
VOCAB_BLOCK = 256
#: Token rows per logits / d-hidden matmul (invariant mode). 128, not 64: MKL runs the
#: logits and d-hidden batches 13-16 % faster per FLOP at 128 rows
#: (bench/lm_head_gemm_shapes.py); a chunk pads to whole tiles (at most 127 zero rows). A row's bits
#: do not depend on the tile size (``HIDDEN_ALIGN``); the d-weight sum does, and goes
#: ``WEIGHT_GRAD_ROWS`` tokens at a time.
TOKEN_TILE = 128
#: Tokens per d-weight product (invariant mode), in token order: part of the numeric
#: identity. 64 keeps the bits (and the fp32 error) of the 64-row tiles this engine had
#: before; 128-token products moved them and measured slightly more error against fp64.
WEIGHT_GRAD_ROWS = 64


#: Blocks per matmul call (fused invariant runner): every call is a batch of exactly this
#: many ``[TOKEN_TILE, ., .]`` products, whatever the TP size, chunk or batch, because
#: GEMM libraries choose their kernel (and summation order) by shape and batch count
#: (cuBLAS sends a batch of 1 to ``gemm`` and more to ``bgemm``).
BLOCK_GROUP = 8
#: The hidden dim of every invariant-mode matmul is zero-padded to a multiple of this: for
#: a few narrow widths (5-7 and 9-11 on MKL / AVX2) the BLAS kernel rounds a row of a
#: ``[TOKEN_TILE, B] x [B, H]`` product differently by its position in the tile, which
#: would make ``d hidden`` depend on the order of the tokens (``tests/unit/
#: test_invariant_shapes.py`` checks the padded widths up to 160, 1024 and 4096).
HIDDEN_ALIGN = 16


class BlockGroup(NamedTuple):
    """One matmul call's ``BLOCK_GROUP`` slots: slot ``i`` is local real block ``start +
    i``; slots ``[lo, hi)`` are the blocks this call adds (the others are padding or
    blocks an earlier call of the same tile already did, and are discarded)."""

    start: int
    lo: int
    hi: int


def block_groups(num_local: int, group: int = BLOCK_GROUP) -> list[BlockGroup]:
    """Cover local real blocks ``[0, num_local)`` by calls of ``group`` slots, in order.

    Full groups from block 0; the last partial group is the window of the last ``group``
    blocks (so its operands are views, never copies), or, with fewer than ``group``
    blocks, one group whose slots past ``num_local`` are zero padding (``start = 0``).
    Example: ``block_groups(10, 8) == [(0, 0, 8), (2, 6, 8)]``; ``block_groups(3, 8) ==
    [(0, 0, 3)]``.
    """
    if num_local < group:
        return [BlockGroup(0, 0, num_local)] if num_local else []
    out = []
    for j0 in range(0, num_local, group):
        start = min(j0, num_local - group)
        out.append(BlockGroup(start, j0 - start, group))
    return out


def num_real_blocks(vocab_size: int, block: int = VOCAB_BLOCK) -> int:
    """``K``: blocks holding at least one true id."""
    return -(-vocab_size // block)


def check_block_aligned(
    shard_rows: int, vocab_start: int, *, block: int = VOCAB_BLOCK, tp_size: int = 1
) -> None:
    """Raise ``ValueError`` unless this rank's shard starts and ends on block boundaries."""
    if shard_rows % block or vocab_start % block:
        raise ValueError(
            f"invariant=True needs the local vocab shard to be a multiple of {block} rows, "
            f"got {shard_rows} rows starting at id {vocab_start} (tp_size={tp_size}); build "
            f"the layer with vocab_shard_ranges(vocab_size, tp_size, multiple={block}) "
            f"(megatron: make_vocab_size_divisible_by={block})"
        )


def shard_columns(target: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Local column of each target id inside ``shard``, else -1."""
    inside = (target >= shard.start) & (target < shard.stop)
    return torch.where(inside, target - shard.start, -1)


@dataclass(frozen=True)
class BlockLayout:
    """Which fixed vocab blocks a rank's ``shard`` holds (pure).

    Example: vocab 1000, TP 2, shards of 512 rows: 4 real blocks; rank 1 holds local
    blocks 0, 1 = global blocks 2, 3 (block 3 has 1000 - 768 = 232 true ids: ``tail``).
    """

    shard: VocabShard
    block: int = VOCAB_BLOCK

    @classmethod
    def of_shard(cls, shard: VocabShard) -> BlockLayout:
        """Check block alignment (before any collective) and describe ``shard``.

        At TP = 1 any width is accepted: the caller pads the one shard to whole blocks with
        ``pad_single_shard`` (padding rows are never computed), which is the layout every
        block-aligned TP size evaluates.
        """
        tp = shard.padded_size // shard.size
        if tp == 1:
            v_local = -(-shard.size // VOCAB_BLOCK) * VOCAB_BLOCK
            shard = VocabShard.of_rank(1, v_local, rank=0, vocab_size=shard.vocab_size)
        check_block_aligned(shard.size, shard.start, tp_size=tp)
        return cls(shard)

    @property
    def vocab_size(self) -> int:
        return self.shard.vocab_size

    @property
    def v_local(self) -> int:
        return self.shard.size

    @property
    def tp_size(self) -> int:
        return self.shard.padded_size // self.shard.size

    @property
    def rank(self) -> int:
        return self.shard.start // self.shard.size

    @property
    def num_real(self) -> int:
        return num_real_blocks(self.vocab_size, self.block)

    @property
    def first(self) -> int:
        """Global index of this rank's first block."""
        return self.shard.start // self.block

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
        """Maximal aligned subtrees held by ``rank`` of this layout (``tree``)."""
        other = VocabShard.of_rank(self.tp_size, self.v_local, rank=rank)
        return local_pieces(other.start // self.block, other.stop // self.block, self.num_real)

    @property
    def max_pieces(self) -> int:
        """Most pieces any rank of this layout holds (``P`` of the gathered partials)."""
        return max_pieces(self.v_local // self.block, self.tp_size, self.num_real)


def pad_single_shard(x: torch.Tensor, dim: int, layout: BlockLayout) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` to its whole real blocks, ``layout.num_local *
    layout.block`` rows (TP = 1 with an unaligned vocab, or a ``DTensor``'s short last shard).

    A TP = 1 shard of any width (e.g. full ``[N, 1000]`` logits or a ``[1000, H]`` weight),
    or the last shard of ``torch.chunk`` (``dtensor_weight``: 253 rows of a 256-row block)
    is made block-aligned by one copy; the added ids are >= ``vocab_size`` (padding), and
    the gradient of ``F.pad`` slices them off. No-op when ``x`` already has the width.
    """
    missing = layout.num_local * layout.block - x.shape[dim]
    if missing <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, missing]
    return torch.nn.functional.pad(x, pad)


class TargetSlots(NamedTuple):
    """Where the targets this rank owns sit in a ``[T, K, TOKEN_TILE, B]`` batch."""

    pos: torch.Tensor  # flat token index (tile * TOKEN_TILE + row) of each owned target
    index: tuple[torch.Tensor, ...]  # (tile, block, row, col), one entry per owned target


def target_slots(target: torch.Tensor, layout: BlockLayout) -> TargetSlots:
    """Slots of ``target [T * TOKEN_TILE]`` (-1 on padded rows) in this rank's real blocks."""
    local = target - layout.shard.start
    owned = (target >= 0) & (local >= 0) & (local < layout.num_local * layout.block)
    pos = owned.nonzero().squeeze(1)
    loc = local[pos]
    b = layout.block
    return TargetSlots(pos, (pos // TOKEN_TILE, loc // b, pos % TOKEN_TILE, loc % b))


def fold_blocks(
    values: torch.Tensor,
    dim: int,
    layout: BlockLayout,
    merge: Callable[[torch.Tensor, int], torch.Tensor],
) -> list[tuple[Piece, torch.Tensor]]:
    """This rank's maximal aligned subtrees (``layout.pieces``), each folded level by level.

    ``values``: local real block ``k`` at index ``k`` of ``dim``. A subtree of ``2**L``
    leaves takes ``L`` batched steps over the pairs ``(2i, 2i + 1)``; ``merge(pairs, d)``
    merges the size-2 dim ``d`` of ``pairs`` element by element: the operations of the
    canonical tree.
    """
    out = []
    for level, idx in layout.pieces(layout.rank):
        v = values.narrow(dim, (idx << level) - layout.first, 1 << level)
        while v.shape[dim] > 1:
            v = merge(v.unflatten(dim, (-1, 2)), dim + 1)
        out.append(((level, idx), v.squeeze(dim)))
    return out
