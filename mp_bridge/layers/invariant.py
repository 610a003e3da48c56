"""Bitwise TP-invariant cross-entropy / log-probs: fixed vocab blocks, fixed tree, fixed tiles.

Results (values and gradients) are **bitwise identical** for every TP size whose local
shard is a whole number of ``VOCAB_BLOCK`` rows, and independent of the chunk size and of
which other tokens share the call.

Sizes (constants in ``vocab_blocks``): vocab blocks of ``VOCAB_BLOCK = 256`` ids, token
tiles of ``TOKEN_TILE = 64`` rows. Neither depends on TP, the chunk or the batch; a
[64, 256] fp32 tile is 16 Ki elements.

TP sizes covered: every TP size when the vocab is laid out with
``vocab_shard_ranges(vocab_size, tp, multiple=VOCAB_BLOCK)`` (megatron:
``make_vocab_size_divisible_by=256``): TP = 1, 2, 3, 4, 8, ... alike (the tests run 1, 2,
3, 4 and 8; the acceptance tests 5 and 6 too). At TP = 1 the unpadded full logits
``[..., vocab_size]`` (or full weight ``[vocab_size, H]``) are accepted as well: they are
zero-padded to whole blocks by one copy (``pad_single_shard``), giving the same bits.
Why: block ``j`` holds ids ``[256 j, 256 (j + 1))`` at every TP size, so a
block-aligned shard holds whole blocks, and any run of whole blocks splits into whole
subtrees of one canonical tree over the blocks (``vocab_blocks``); each rank folds its
subtrees, the subtree results are gathered and every rank folds them in the same tree
order, which is the expression TP = 1 evaluates. The padding differs between TP sizes,
but padding blocks are never computed. A shard that is not block-aligned (e.g. plain
``vocab_shard_ranges(vocab_size, tp)`` with 1250 rows) cannot give the same expression
and is rejected with a ``ValueError`` before any collective.

How:

1. Matmuls (fused path): one ``[64, H] x [H, 256]`` logits matmul per (tile, block),
   ``[256, 64] x [64, H]`` for the weight gradient (tiles added in token order) and
   ``[64, 256] x [256, H]`` for the hidden gradient, whatever TP, chunk or token count.
2. Block math: a chunk's logits are one contiguous fp32 batch ``[T, K, 64, 256]`` (T
   tiles, K real local blocks). Every op on it is element-wise, a reduction over the
   last dim, or one indexed element per row, so each row's bits depend on that row alone,
   not on T or K (ATen reduces a row whole with the same kernel whatever the number of
   rows, its threads split rows not a row; element-wise results do not depend on where
   a kernel's vector body ends: checked, exp included, with 1-3 threads on this build,
   and by a unit test with 1-3 threads).
3. Per (tile, block) fp32 partials ``[m, s, tl, sz]`` per token (block max, sum of
   ``exp(z - m)``, target logit if the target is in the block else 0, sum of logits); a
   rank folds its blocks into maximal aligned subtrees (level by level, batched), one
   all-gather over ``tp_group`` brings every rank's subtree partials, and every rank folds
   them in the same tree order (``combine_stats``: online log-sum-exp).
4. ``lse = m + log(s)``; values follow; the gradient is ``exp(z - m) * exp(m - lse)``
   turned into ``d value / d z`` element-wise; the hidden-gradient partials of the blocks
   are summed in the same tree (never by an all-reduce, whose order depends on TP).

Collectives: one all-gather per call of ``[P, 4, tiles, TOKEN_TILE]`` fp32 (``P`` = the
most subtrees a rank holds; 1 when shards are power-of-two aligned); none in backward.
The fused path adds one all-gather of ``[P, tiles, TOKEN_TILE, H]`` per chunk for the
hidden gradient (see ``_fused_engine``).

Cost: the same FLOPs as the default path, in fixed small matmuls (on one CPU thread here
they run at 70-90 GFLOP/s, as fast as the default path's one big GEMM; ``TOKEN_TILE =
128`` would gain about 10 % on them; a ``bmm`` over all blocks of a tile gives the same
bits per block on this build but is no faster, so each block keeps its own ``mm``). The
block math is about 10 batched kernels per chunk, not per (tile, block). Extra memory:
the chunk's fp32 logits (as in the default path), O(log K) ``[TOKEN_TILE, H]`` fp32
partials of the hidden gradient and ``P`` ``[chunk, H]`` subtree results. The hidden
gradient costs ``K - 1`` adds of ``[TOKEN_TILE, H]`` per tile in tree order and, at
TP > 1, an all-gather in place of an all-reduce. Measured fwd+bwd (d)/(c) = 1.01 / 1.07
/ 1.09 at V = 64k, TP 1/2/4, N = 4096, H = 1024 on CPU (``bench/RESULTS.md``). Bits are
identical for a given machine, torch/BLAS build and intra-op thread count; the GEMM
kernels of another build may round differently.
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
    "TOKEN_TILE",
    "VOCAB_BLOCK",
    "BlockLayout",
    "TargetSlots",
    "block_col",
    "block_grad_",
    "block_stats_",
    "combine_stats",
    "exp_shift_",
    "fold_blocks",
    "gather_fold",
    "invariant_cross_entropy",
    "invariant_logprobs",
    "pad_single_shard",
    "stats_values",
    "target_slots",
]

#: Materialized path: tiles per batch, about this many fp32 logits (8 MiB) per batch.
_BATCH_ELEMENTS = 1 << 21


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
def _pad(v: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    if v.shape[0] == rows:
        return v
    out = v.new_full((rows, *v.shape[1:]), fill)
    out[: v.shape[0]] = v
    return out


def _copy_rows(z: torch.Tensor, rows: torch.Tensor, to_z: bool) -> None:
    """Copy between ``rows [r, K, B]`` and the first ``r`` tile-major rows of ``z [T, K,
    TOKEN_TILE, B]`` (``to_z``: into ``z``, else out of it), casting the dtype."""
    zt = z.permute(0, 2, 1, 3)  # [T, TOKEN_TILE, K, B], a view
    full, rem = divmod(rows.shape[0], TOKEN_TILE)
    pairs = []
    if full:
        pairs.append((zt[:full], rows[: full * TOKEN_TILE].unflatten(0, (full, TOKEN_TILE))))
    if rem:
        pairs.append((zt[full, :rem], rows[full * TOKEN_TILE :]))
    for zp, rp in pairs:
        if to_z:
            zp.copy_(rp)
        else:
            rp.copy_(zp)


class _InvariantVocabLoss(torch.autograd.Function):
    """Per-token values over materialized vocab-parallel logits, in batches of tiles.

    Forward: one all-gather of subtree partials. Backward (no collective): recompute each
    block's ``exp(z - m)`` and rescale it with the saved lse; ``grad_logits = upstream *
    d value / d logits``.
    """

    @staticmethod
    def forward(ctx, logits, target, tp_group, layout: BlockLayout, spec: LossSpec):
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n = x.shape[0]
        tiles = -(-n // TOKEN_TILE)
        with_sum = spec.coefficients[2] != 0.0
        shape = (4, tiles, TOKEN_TILE)
        parts = []
        for _, _, z, slots in _batches(x, t, layout, spec.temperature):
            stats, _ = block_stats_(z, layout, slots, with_sum)
            parts.append(fold_blocks(stats, 2, layout, combine_stats))
        pieces = [  # this rank's pieces over all tiles (none when it holds no real block)
            (
                piece,
                torch.cat([part[p][1] for part in parts], dim=1)
                if parts
                else x.new_zeros(shape, dtype=torch.float32),
            )
            for p, piece in enumerate(layout.pieces(layout.rank))
        ]
        root = gather_fold(pieces, layout, tp_group, combine_stats, shape, x.device)
        value, lse = (v.reshape(-1)[:n] for v in stats_values(root, spec))
        if spec.ignore_index is not None:
            value = value.masked_fill(t == spec.ignore_index, 0.0)
        ctx.save_for_backward(logits, target, lse)
        ctx.layout, ctx.spec = layout, spec
        return value.view(target.shape)

    @staticmethod
    def backward(ctx, grad_value):
        logits, target, lse = ctx.saved_tensors
        layout, spec = ctx.layout, ctx.spec
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n, kb = x.shape[0], layout.num_local * layout.block
        w = spec.token_weight(t) * grad_value.reshape(-1).float()
        grad = torch.zeros_like(x)
        for i0, i1, z, slots in _batches(x, t, layout, spec.temperature):
            r0, r1, rows = i0 * TOKEN_TILE, min(i1 * TOKEN_TILE, n), (i1 - i0) * TOKEN_TILE
            m = exp_shift_(z, layout)
            lse_b = _pad(lse[r0:r1], rows, 0.0).view(i1 - i0, TOKEN_TILE)
            w_b = _pad(w[r0:r1], rows, 0.0).view(i1 - i0, TOKEN_TILE)
            g = block_grad_(z, m, lse_b, w_b, slots, layout, spec)
            _copy_rows(g, grad[r0:r1, :kb].unflatten(1, (-1, layout.block)), to_z=False)
        return grad.view(logits.shape), None, None, None, None


def _batches(x: torch.Tensor, t: torch.Tensor, layout: BlockLayout, temperature: float):
    """``(i0, i1, z, slots)`` per batch of tiles ``[i0, i1)``: ``z`` the fp32 ``[i1 - i0,
    K, TOKEN_TILE, B]`` copy of the real blocks (zero padded rows), about
    ``_BATCH_ELEMENTS`` logits each."""
    n, k, b = x.shape[0], layout.num_local, layout.block
    tiles = -(-n // TOKEN_TILE)
    per = max(1, _BATCH_ELEMENTS // (TOKEN_TILE * max(k * b, 1)))
    for i0 in range(0, tiles, per):
        i1 = min(i0 + per, tiles)
        r0, r1 = i0 * TOKEN_TILE, min(i1 * TOKEN_TILE, n)
        z = torch.zeros((i1 - i0, k, TOKEN_TILE, b), dtype=torch.float32, device=x.device)
        _copy_rows(z, x[r0:r1, : k * b].unflatten(1, (k, b)), to_z=True)
        if temperature != 1.0:
            z.div_(temperature)
        slots = target_slots(_pad(t[r0:r1], (i1 - i0) * TOKEN_TILE, -1), layout)
        yield i0, i1, z, slots


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
    logits = pad_single_shard(logits, -1, layout)
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
    logits = pad_single_shard(logits, -1, layout)
    return _InvariantVocabLoss.apply(logits, target, tp_group, layout, spec)
