"""Autograd Functions over materialized vocab-parallel logits ``[..., V_local]``.

- ``DefaultLoss``: the per-token values of a ``LossSpec`` (cross-entropy with smoothing and
  z-loss, or log-probs; optionally the entropy of the same softmax as a second output)
  over the whole local shard, by the formulas of ``formulas``: ``row_stats_`` shifted by
  the global row max (``all_reduce_max_``), then one ``all_reduce_sum_`` of the other
  statistics, and ``stats_values``. Backward, no collective: the saved ``lse`` turns
  recomputed logits into the softmax, then ``softmax_grad_rows_`` (weight last), times
  the soft-cap derivative. The entropy alone is the second output of a log-prob spec
  (every target -1 when none marks ignored tokens).
- ``InvariantLoss`` (``invariant=True``): the affine form of ``LossSpec`` (and its entropy) on fixed
  ``[TOKEN_TILE, VOCAB_BLOCK]`` tiles in batches of tiles, one ``gather_fold`` per call;
  backward recomputes each block's ``exp(z - m)`` and applies ``softmax_grad_blocks_``.

Both take ``T`` from ``LossSpec.temperature`` or from a flat per-token ``temp [N]``
(``DefaultLoss``: the accumulation dtype; ``InvariantLoss``: fp32). The statistics are
those the spec asks for (``formulas.STATS``: an extra per-token output widens the same
exchange); both return the fields of one ``outputs.TokenOutputs``.

Logits are never modified; padding columns (ids >= ``vocab_size``) never enter a softmax;
``-inf`` logits are exact zeros of every sum (``formulas``). Statistics are fp32 (fp64
for fp64 logits in ``DefaultLoss``); input gradients have the logits' dtype. Every backward
refuses ``create_graph=True`` (``forbid_double_backward``).
"""

from __future__ import annotations

import torch

from mp_bridge.layers.loss.arguments import forbid_double_backward
from mp_bridge.layers.loss.blocks import (
    TOKEN_TILE,
    BlockLayout,
    fold_blocks,
    shard_columns,
    target_slots,
)
from mp_bridge.layers.loss.class_weights import column_weights, target_weights
from mp_bridge.layers.loss.formulas import (
    LossSpec,
    block_stats_,
    exp_shift_,
    row_stats_,
    stats_values,
    transform_logits_,
)
from mp_bridge.layers.loss.grad import softmax_grad_blocks_, softmax_grad_rows_
from mp_bridge.layers.loss.reduce import all_reduce_max_, all_reduce_sum_, gather_fold
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = ["InvariantLoss", "DefaultLoss"]

#: Invariant path: tiles per batch, about this many fp32 logits (8 MiB) per batch.
BATCH_ELEMENTS = 1 << 21


def _transformed(
    logits: torch.Tensor, shard: VocabShard, spec: LossSpec, temp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[C, V_local]`` fp32 (fp64 for fp64) copy of ``softcap(logits) / T``, padding
    columns at ``-inf``, and the soft-cap derivative (0 on padding; ``None``: no cap)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(acc, copy=True)
    deriv = transform_logits_(z, spec, None if temp is None else temp.unsqueeze(1))
    if shard.num_real < shard.size:  # columns [num_real, V_local) are padding
        z[:, shard.num_real :] = float("-inf")
        if deriv is not None:
            deriv[:, shard.num_real :] = 0.0
    return z, deriv


class DefaultLoss(torch.autograd.Function):
    """See the module docstring. Returns the ``TokenOutputs.tensors`` shaped like
    ``target``. ``temp``: the per-token temperature ``[N]`` in the accumulation dtype, or
    ``None``."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, shard: VocabShard, spec: LossSpec, temp=None):
        z, _ = _transformed(logits, shard, spec, temp)
        t = target.reshape(-1)
        m = all_reduce_max_(z.amax(dim=-1), tp_group)  # global row max (-inf: all -inf)
        col = shard_columns(t, shard)
        colw = column_weights(spec, shard.start, z.shape[1])
        stats, _ = row_stats_(z, col, shard.num_real, spec, shift=m, colw=colw)
        del z
        all_reduce_sum_(stats[1:], tp_group)  # every statistic but the max
        ignored = t == spec.ignore_index if spec.ignore_index is not None else None
        omega = target_weights(spec, t)
        out = stats_values(stats, spec, relative=True, omega=omega).masked(ignored)
        lse = out.lse
        # shaped before marking: a view of a marked output would not be marked
        out = out.map(lambda v: v.view(target.shape))
        ctx.save_for_backward(logits, t, lse, out.entropy, temp)
        ctx.args = (shard, spec)
        return out.tensors(ctx)

    @staticmethod
    def backward(ctx, grad_value, grad_entropy, grad_z_loss, grad_sq):
        forbid_double_backward("vocab_parallel_cross_entropy / logprobs / entropy")
        logits, t, lse, entropy, temp = ctx.saved_tensors
        shard, spec = ctx.args
        z, deriv = _transformed(logits, shard, spec, temp)
        p = z.sub_(lse.unsqueeze(-1)).exp_()  # softmax; padding columns exp(-inf) = 0
        col = shard_columns(t, shard)
        token = spec.token_weight(t, temp, p.dtype)  # 1 / T, 0 on ignored tokens
        w = grad_value.reshape(-1).to(p.dtype) * token
        w_ent = grad_entropy.reshape(-1).to(p.dtype) * token if spec.entropy else None
        grad = softmax_grad_rows_(
            p,
            col,
            w,
            spec,
            shard.num_real,
            weight_last=True,
            lse=lse,
            entropy=None if entropy is None else entropy.reshape(-1),
            w_ent=w_ent,
            omega=target_weights(spec, t),
            colw=column_weights(spec, shard.start, p.shape[1]),
        )
        if deriv is not None:
            grad.mul_(deriv)
        return grad.to(logits.dtype).view(logits.shape), None, None, None, None, None


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


def _batches(x: torch.Tensor, t: torch.Tensor, layout: BlockLayout, spec: LossSpec, temp=None):
    """``(i0, i1, z, deriv, slots)`` per batch of tiles ``[i0, i1)``: ``z`` the fp32
    transformed ``[i1 - i0, K, TOKEN_TILE, B]`` copy of the real blocks (zero padded rows),
    about ``BATCH_ELEMENTS`` logits each; ``deriv`` its soft-cap derivative or ``None``.
    ``temp``: fp32 per-token temperature ``[N]`` or ``None`` (``spec.temperature``)."""
    n, k, b = x.shape[0], layout.num_local, layout.block
    tiles = -(-n // TOKEN_TILE)
    per = max(1, BATCH_ELEMENTS // (TOKEN_TILE * max(k * b, 1)))
    for i0 in range(0, tiles, per):
        i1 = min(i0 + per, tiles)
        r0, r1 = i0 * TOKEN_TILE, min(i1 * TOKEN_TILE, n)
        z = torch.zeros((i1 - i0, k, TOKEN_TILE, b), dtype=torch.float32, device=x.device)
        _copy_rows(z, x[r0:r1, : k * b].unflatten(1, (k, b)), to_z=True)
        tt = None
        if temp is not None:  # padded rows divide by 1
            tt = _pad(temp[r0:r1], (i1 - i0) * TOKEN_TILE, 1.0).view(-1, 1, TOKEN_TILE, 1)
        deriv = transform_logits_(z, spec, tt)
        if deriv is not None and k and layout.tail < b:
            deriv[:, k - 1, :, layout.tail :] = 0.0  # padding columns: whatever the caller had
        slots = target_slots(_pad(t[r0:r1], (i1 - i0) * TOKEN_TILE, -1), layout)
        yield i0, i1, z, deriv, slots


def _block_weights(spec: LossSpec, layout: BlockLayout) -> torch.Tensor | None:
    """``[K, B]`` class weights of this rank's real blocks (``None`` without them)."""
    k, b = layout.num_local, layout.block
    colw = column_weights(spec, layout.first * b, k * b)
    return None if colw is None else colw.view(k, b)


def _rows(v: torch.Tensor | None, r0: int, r1: int, rows: int) -> torch.Tensor | None:
    """Rows ``[r0, r1)`` of the per-token ``v``, zero padded to ``[rows // TOKEN_TILE,
    TOKEN_TILE]``."""
    return None if v is None else _pad(v[r0:r1], rows, 0.0).view(-1, TOKEN_TILE)


class InvariantLoss(torch.autograd.Function):
    """Per-token values of ``spec`` over block-aligned logits, bitwise TP-invariant.

    Returns the ``TokenOutputs.tensors`` like ``DefaultLoss``; ``temp``: the fp32
    per-token temperature ``[N]`` (flattened tokens) or ``None``."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, layout: BlockLayout, spec: LossSpec, temp=None):
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n = x.shape[0]
        shape = (spec.num_stats, -(-n // TOKEN_TILE), TOKEN_TILE)
        parts = []
        colw = _block_weights(spec, layout)
        for _, _, z, _, slots in _batches(x, t, layout, spec, temp):
            stats, _ = block_stats_(z, layout, slots, spec, colw)
            parts.append(fold_blocks(stats, 2, layout, spec.merge))
        pieces = [  # this rank's pieces over all tiles (none when it holds no real block)
            (
                piece,
                torch.cat([part[p][1] for part in parts], dim=1)
                if parts
                else x.new_zeros(shape, dtype=torch.float32),
            )
            for p, piece in enumerate(layout.pieces(layout.rank))
        ]
        root = gather_fold(pieces, layout, tp_group, spec.combine, shape, x.device)
        ignored = t == spec.ignore_index if spec.ignore_index is not None else None
        omega = _pad(t, shape[1] * TOKEN_TILE, -1).view(-1, TOKEN_TILE)
        omega = target_weights(spec, omega)
        out = stats_values(root, spec, omega=omega).map(lambda v: v.reshape(-1)[:n])
        out = out.masked(ignored)
        ctx.save_for_backward(logits, target, out.lse, out.entropy, temp)
        ctx.layout, ctx.spec = layout, spec
        # shaped before marking: a view of a marked output would not be marked
        return out.map(lambda v: v.view(target.shape)).tensors(ctx)

    @staticmethod
    def backward(ctx, grad_value, grad_entropy, grad_z_loss, grad_sq):
        forbid_double_backward("vocab_parallel_cross_entropy / logprobs (invariant=True)")
        logits, target, lse, entropy, temp = ctx.saved_tensors
        layout, spec = ctx.layout, ctx.spec
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n, kb = x.shape[0], layout.num_local * layout.block
        token = spec.token_weight(t, temp)
        w = token * grad_value.reshape(-1).float()
        w_ent = token * grad_entropy.reshape(-1).float() if spec.entropy else None
        grad = torch.zeros_like(x)
        omega, colw = target_weights(spec, t), _block_weights(spec, layout)
        for i0, i1, z, deriv, slots in _batches(x, t, layout, spec, temp):
            r0, r1, rows = i0 * TOKEN_TILE, min(i1 * TOKEN_TILE, n), (i1 - i0) * TOKEN_TILE
            m = exp_shift_(z, layout)
            g = softmax_grad_blocks_(
                z,
                m,
                _rows(lse, r0, r1, rows),
                _rows(w, r0, r1, rows),
                slots,
                layout,
                spec,
                entropy=_rows(entropy, r0, r1, rows),
                w_ent=_rows(w_ent, r0, r1, rows),
                omega=_rows(omega, r0, r1, rows),
                colw=colw,
            )
            if deriv is not None:
                g.mul_(deriv)
            _copy_rows(g, grad[r0:r1, :kb].unflatten(1, (-1, layout.block)), to_z=False)
        return grad.view(logits.shape), None, None, None, None, None
