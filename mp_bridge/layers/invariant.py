"""Bitwise TP-invariant cross-entropy / log-probs: fixed vocab blocks, fixed tree, fixed tiles.

Results (values and gradients) are **bitwise identical** for every TP size whose local
shard is a whole number of ``VOCAB_BLOCK`` (= 256) rows, i.e. every TP size when the
vocab is laid out with ``vocab_shard_ranges(vocab_size, tp, multiple=VOCAB_BLOCK)``
(TP = 1, 2, 3, 4, 8, ... alike; the padding differs between them but padding blocks are
never computed). They are also independent of which other tokens share the call.

How (see ``vocab_blocks`` for the tree):

1. Every floating-point operation has a shape that depends on nothing but the two
   constants: tokens are cut into tiles of ``TOKEN_TILE`` rows (the last one zero-padded)
   and each (tile, block) pair is a contiguous fp32 ``[TOKEN_TILE, VOCAB_BLOCK]`` tensor.
   Element-wise math, row reductions and (fused path) matmuls see the same shapes,
   strides and kernels at every TP size, and a row never mixes with another row.
2. Per (tile, block): fp32 partials ``[m, s, tl, sz]`` per token (block max, sum of
   ``exp(z - m)``, target logit if the target is in the block else 0, sum of logits).
3. A rank folds its blocks into maximal aligned subtrees of the canonical tree; one
   all-gather over ``tp_group`` brings every rank's subtree partials, and every rank
   folds them in the same tree order (``combine_stats``: online log-sum-exp).
4. ``lse = m + log(s)``; values and ``softmax = exp(z - lse)`` follow element-wise.

Collectives: one all-gather per call of ``[P, tiles, 4, TOKEN_TILE]`` fp32 (``P`` = the
most subtrees a rank holds; 1 when shards are power-of-two aligned); none in backward.
Cost against ``vocab_parallel_cross_entropy``: a fixed tiled loop (Python overhead per
(tile, block), ~15 small kernels) and an fp32 copy of each block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    stream_fold,
)

__all__ = [
    "TOKEN_TILE",
    "VOCAB_BLOCK",
    "BlockLayout",
    "block_grad_",
    "softmax_to_grad_",
    "block_stats",
    "combine_stats",
    "gather_fold",
    "invariant_cross_entropy",
    "invariant_logprobs",
    "stats_values",
]


@dataclass(frozen=True)
class BlockLayout:
    """Which fixed vocab blocks this rank holds (pure).

    Example: vocab 1000, TP 2, shards of 512 rows: 4 real blocks; rank 1 holds local
    blocks 0, 1 = global blocks 2, 3 (block 3 has 1000 - 768 = 232 true ids).
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
    def real_local_blocks(self) -> range:
        """Local block indices holding at least one true id."""
        return range(max(0, min(self.v_local // self.block, self.num_real - self.first)))

    def valid(self, j: int) -> int:
        """True ids in local block ``j`` (``block``, except for the last real block)."""
        return min(self.block, self.vocab_size - (self.first + j) * self.block)

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
        """Validate block alignment (before any collective) and describe this shard."""
        tp, rank = group_size(tp_group), group_rank(tp_group)
        vocab = check_vocab_size(vocab_size, v_local * tp, v_local, tp)
        check_block_aligned(v_local, rank * v_local, tp_size=tp)
        return cls(vocab, v_local, tp, rank)


# ------------------------------------------------------------- per-block numerics
def block_stats(z: torch.Tensor, valid: int, col: torch.Tensor, with_sum: bool) -> torch.Tensor:
    """``[4, rows]`` fp32 partials ``(max, sum exp(z - max), z[col] or 0, sum z)`` of a block.

    ``z``: contiguous fp32 ``[rows, cols]`` (overwritten: columns ``>= valid`` -> -inf);
    ``col``: ``[rows]`` local column of the target, -1 if not in this block. A block with
    ``valid == 0`` gives the identity ``(-inf, 0, 0, 0)``.
    """
    rows = z.shape[0]
    if valid <= 0:
        out = torch.zeros(4, rows, dtype=torch.float32, device=z.device)
        out[0] = float("-inf")
        return out
    if valid < z.shape[1]:
        z[:, valid:] = float("-inf")
    m = z.amax(dim=1)
    s = torch.exp(z - m.unsqueeze(1)).sum(dim=1)
    owned = col >= 0
    tl = torch.where(owned, z.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    sz = z[:, :valid].sum(dim=1) if with_sum else torch.zeros_like(m)
    return torch.stack([m, s, tl, sz])


def combine_stats(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Online log-sum-exp merge of two ``[4, rows]`` partials (x left of y in vocab order)."""
    m = torch.maximum(x[0], y[0])
    # exp(-inf - m) = 0 keeps an all-padding partial (-inf, 0) an exact no-op.
    s = x[1] * torch.exp(x[0] - m) + y[1] * torch.exp(y[0] - m)
    return torch.stack([m, s, x[2] + y[2], x[3] + y[3]])


def stats_values(root: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, lse)`` per token from folded ``[4, rows]`` stats (affine form of LossSpec)."""
    a, b, c = spec.coefficients
    lse = root[0] + torch.log(root[1])
    value = lse * a + root[2] * b
    if c != 0.0:
        value = value + root[3] * c
    return value, lse


def block_grad_(
    z: torch.Tensor,
    valid: int,
    col: torch.Tensor,
    lse: torch.Tensor,
    w: torch.Tensor,
    spec: LossSpec,
) -> torch.Tensor:
    """Turn block logits ``z [rows, cols]`` (fp32, contiguous) into ``d value / d z`` in place.

    ``w [rows]``: per-token factor (upstream grad / temperature; 0 for ignored or padded
    rows). Result: ``w * (a * softmax + c)`` on true columns, plus ``w * b`` at the
    target; 0 on padding columns.
    """
    if valid < z.shape[1]:
        z[:, max(valid, 0) :] = float("-inf")
    return softmax_to_grad_(z.sub_(lse.unsqueeze(1)).exp_(), valid, col, w, spec)


def softmax_to_grad_(
    z: torch.Tensor, valid: int, col: torch.Tensor, w: torch.Tensor, spec: LossSpec
) -> torch.Tensor:
    """Second half of ``block_grad_``: ``z`` already holds the softmax (0 on padding)."""
    a, b, c = spec.coefficients
    if a != 1.0:
        z.mul_(a)
    if c != 0.0 and valid > 0:
        z[:, :valid].add_(c)
    z.mul_(w.unsqueeze(1))
    # Rows whose target is elsewhere add an exact 0 at column 0.
    z.scatter_add_(1, col.clamp(min=0).unsqueeze(1), torch.where(col >= 0, w * b, 0.0).unsqueeze(1))
    return z


def block_col(target: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Local column of each target inside ids ``[start, start + width)``, else -1."""
    inside = (target >= start) & (target < start + width)
    return torch.where(inside, target - start, -1)


# ------------------------------------------------------------- cross-rank tree fold
def gather_fold(
    local: Sequence[list[tuple[Piece, torch.Tensor]]],
    layout: BlockLayout,
    tp_group: dist.ProcessGroup | None,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    like: torch.Tensor,
) -> list[torch.Tensor]:
    """Per tile, the root of the canonical tree from every rank's subtree partials.

    ``local[i]``: this rank's ``(piece, value)`` list for tile ``i`` (same pieces for
    every tile); ``like``: a tensor shaped like one value. One all-gather of
    ``[P, tiles, *value.shape]`` over ``tp_group`` (none when TP = 1).
    """
    tiles = len(local)
    p_max = layout.max_pieces
    packed = like.new_zeros((p_max, tiles, *like.shape))
    for i, pieces in enumerate(local):
        for p, (_, value) in enumerate(pieces):
            packed[p, i] = value
    tp = layout.tp_size
    gathered = all_gather_tensor(packed, tp_group, 0).view(tp, p_max, tiles, *like.shape)
    owners = [layout.pieces(r) for r in range(tp)]
    roots = []
    for i in range(tiles):
        pieces = {piece: gathered[r, p, i] for r in range(tp) for p, piece in enumerate(owners[r])}
        roots.append(fold_tree(pieces, layout.num_real, combine))
    return roots


def tile_blocks(
    x: torch.Tensor, rows: slice, layout: BlockLayout, temperature: float
) -> list[torch.Tensor]:
    """fp32 ``[TOKEN_TILE, block]`` copies of the real local blocks of ``x[rows]``."""
    n = rows.stop - rows.start
    out = []
    for j in layout.real_local_blocks:
        z = x.new_zeros((TOKEN_TILE, layout.block), dtype=torch.float32)
        z[:n] = x[rows, j * layout.block : (j + 1) * layout.block]
        if temperature != 1.0:
            z.div_(temperature)
        out.append(z)
    return out


# ------------------------------------------------------------- materialized logits
class _InvariantVocabLoss(torch.autograd.Function):
    """Per-token values over materialized vocab-parallel logits, tile by tile.

    Forward: one all-gather of subtree partials. Backward (no collective): recompute each
    block's softmax from the saved lse; ``grad_logits = upstream * d value / d logits``.
    """

    @staticmethod
    def forward(ctx, logits, target, tp_group, layout: BlockLayout, spec: LossSpec):
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n = x.shape[0]
        tiles = [slice(s, min(s + TOKEN_TILE, n)) for s in range(0, n, TOKEN_TILE)]
        with_sum = spec.coefficients[2] != 0.0
        local = []
        for rows in tiles:
            tgt = _pad_rows(t[rows], -1)
            blocks = tile_blocks(x, rows, layout, spec.temperature)
            leaves = (
                (layout.first + j, block_stats(z, layout.valid(j), _col(tgt, layout, j), with_sum))
                for j, z in zip(layout.real_local_blocks, blocks)
            )
            local.append(stream_fold(leaves, combine_stats))
        like = torch.zeros(4, TOKEN_TILE, device=x.device)
        roots = gather_fold(local, layout, tp_group, combine_stats, like)
        values, lses = zip(*(stats_values(r, spec) for r in roots)) if roots else ((), ())
        value = torch.cat(values)[:n] if n else x.new_zeros(0, dtype=torch.float32)
        lse = torch.cat(lses) if n else value
        if spec.ignore_index is not None:
            value = value.masked_fill(t == spec.ignore_index, 0.0)
        ctx.save_for_backward(logits, target, lse)
        ctx.layout, ctx.spec, ctx.tiles = layout, spec, tiles
        return value.view(target.shape)

    @staticmethod
    def backward(ctx, grad_value):
        logits, target, lse = ctx.saved_tensors
        layout, spec = ctx.layout, ctx.spec
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        w = spec.token_weight(t) * grad_value.reshape(-1).float()
        grad = torch.zeros_like(x)
        for i, rows in enumerate(ctx.tiles):
            n = rows.stop - rows.start
            tgt, wt = _pad_rows(t[rows], -1), _pad_rows(w[rows], 0.0)
            lse_t = lse[i * TOKEN_TILE : (i + 1) * TOKEN_TILE]
            blocks = tile_blocks(x, rows, layout, spec.temperature)
            for j, z in zip(layout.real_local_blocks, blocks):
                g = block_grad_(z, layout.valid(j), _col(tgt, layout, j), lse_t, wt, spec)
                grad[rows, j * layout.block : (j + 1) * layout.block] = g[:n]
        return grad.view(logits.shape), None, None, None, None


def _pad_rows(v: torch.Tensor, fill: float) -> torch.Tensor:
    if v.shape[0] == TOKEN_TILE:
        return v
    out = v.new_full((TOKEN_TILE,), fill)
    out[: v.shape[0]] = v
    return out


def _col(target: torch.Tensor, layout: BlockLayout, j: int) -> torch.Tensor:
    return block_col(target, (layout.first + j) * layout.block, layout.block)


def invariant_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """Per-token cross-entropy ``[...]`` (fp32) of vocab-parallel ``logits [..., V_local]``.

    Same semantics as ``vocab_parallel_cross_entropy`` (ignored tokens: 0 and grad 0;
    smoothing over the true vocab); bitwise identical across block-aligned TP sizes and
    batch compositions. ``target`` is validated by the caller.
    """
    layout = BlockLayout.for_shard(logits.shape[-1], vocab_size, tp_group)
    spec = LossSpec("ce", layout.vocab_size, ignore_index, float(label_smoothing))
    return _InvariantVocabLoss.apply(logits, target, tp_group, layout, spec)


def invariant_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    temperature: float,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[target]`` ``[...]`` (fp32), bitwise TP-invariant."""
    layout = BlockLayout.for_shard(logits.shape[-1], vocab_size, tp_group)
    spec = LossSpec("logprob", layout.vocab_size, None, 0.0, float(temperature))
    return _InvariantVocabLoss.apply(logits, target, tp_group, layout, spec)
