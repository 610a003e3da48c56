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

import torch
import torch.distributed as dist

from ._loss_common import LossSpec
from .invariant_blocks import (
    BlockLayout,
    block_grad_,
    block_stats_,
    combine_stats,
    exp_shift_,
    fold_blocks,
    gather_fold,
    pad_single_shard,
    stats_values,
    target_slots,
)
from .vocab_blocks import TOKEN_TILE, VOCAB_BLOCK

__all__ = ["TOKEN_TILE", "VOCAB_BLOCK", "invariant_cross_entropy", "invariant_logprobs"]

#: Materialized path: tiles per batch, about this many fp32 logits (8 MiB) per batch.
_BATCH_ELEMENTS = 1 << 21


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
