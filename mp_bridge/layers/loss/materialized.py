"""Autograd Functions over materialized vocab-parallel logits ``[..., V_local]``.

- ``DefaultCrossEntropy``: per-token ``(1-eps) * nll + eps * smooth (+ zw * lse**2)`` of
  ``scale * softcap(logits)`` (ignored tokens 0), optionally with the entropy of the same
  softmax as a second output. Forward: the global row max (``all_reduce_max_``), then one
  batched ``all_reduce_sum_`` of ``[sum_c exp(z_c - m), z_t - m, sum_c (z_c - m), sum_c
  exp(z_c - m) (z_c - m), sum_c exp(z_c - m)**2]`` (the third only with smoothing, the
  fourth only with entropy, the last only with ``sum_pi_squared``).
  Backward, no collective: the saved ``m + lse`` turns recomputed logits into the
  softmax, then ``softmax_grad_rows_`` (weight last), times the soft-cap derivative.
- ``DefaultEntropy``: ``-sum_c p_c log p_c`` of ``scale * softcap(logits)``; forward MAX,
  then SUM of ``[sum exp(z - m), sum exp(z - m) (z - m)]``; backward ``-g p_j (log p_j +
  H)`` times ``scale`` and the soft-cap derivative; 0 at ``ignored`` tokens.
- ``InvariantLoss``: the affine form of ``LossSpec`` (and its entropy) on fixed
  ``[TOKEN_TILE, VOCAB_BLOCK]`` tiles in batches of tiles, one ``gather_fold`` per call;
  backward recomputes each block's ``exp(z - m)`` and applies ``softmax_grad_blocks_``.

``scale`` is ``1 / T``: a float, or a per-token tensor shaped like the logits without the
vocab dim (the accumulation dtype); ``InvariantLoss`` takes ``LossSpec.temperature`` or a
flat fp32 per-token ``temp``. The ``sum_pi_squared`` output has no gradient.

Logits are never modified; padding columns (ids >= ``vocab_size``) never enter a softmax;
``-inf`` logits are exact zeros of every sum (``loss_math``). Statistics are fp32 (fp64
for fp64 logits); input gradients have the logits' dtype. Every backward refuses
``create_graph=True`` (``forbid_double_backward``).
"""

from __future__ import annotations

import torch

from mp_bridge.layers.loss.blocks import (
    TOKEN_TILE,
    BlockLayout,
    fold_blocks,
    shard_columns,
    target_slots,
)
from mp_bridge.layers.loss.checks import forbid_double_backward
from mp_bridge.layers.loss.formulas import (
    LossSpec,
    block_stats_,
    entropy_of,
    exp_shift_,
    safe_shift,
    softcap_,
    stats_values,
    transform_logits_,
)
from mp_bridge.layers.loss.grad import softmax_grad_blocks_, softmax_grad_rows_
from mp_bridge.layers.loss.reduce import all_reduce_max_, all_reduce_sum_, gather_fold
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = ["DefaultCrossEntropy", "DefaultEntropy", "InvariantLoss"]

#: Invariant path: tiles per batch, about this many fp32 logits (8 MiB) per batch.
BATCH_ELEMENTS = 1 << 21


def _masked_fp32(
    logits: torch.Tensor, shard: VocabShard, scale, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 (fp64 for fp64) ``scale * softcap(logits)`` with padding columns at ``-inf``,
    and the soft-cap derivative (0 on padding; ``None`` without a cap)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    deriv = None
    if softcap is not None:
        x = x.clone() if x.data_ptr() == logits.data_ptr() else x
        deriv = softcap_(x, softcap)
    if isinstance(scale, torch.Tensor):
        x = x * scale.unsqueeze(-1)
    elif scale != 1.0:
        x = x * scale
    if shard.num_real < shard.size:  # columns [num_real, V_local) are padding
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()  # fp32 input: never write into the caller's tensor
        x[..., shard.num_real :] = float("-inf")
        if deriv is not None:
            deriv[..., shard.num_real :] = 0.0
    return x, deriv


def _shifted(logits, shard, scale, softcap, tp_group):
    """``(x - m, m, deriv)``: masked logits shifted by the global row max ``m`` (0 where a
    row is all ``-inf``)."""
    x, deriv = _masked_fp32(logits, shard, scale, softcap)
    m = safe_shift(all_reduce_max_(x.detach().amax(dim=-1), tp_group))
    return x - m.unsqueeze(-1), m, deriv


def _xexp(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``sum exp(x) x`` over the last dim (``exp(-inf) * -inf`` counts 0, not nan)."""
    return torch.where(e > 0, e * x, 0.0).sum(-1)


def _outputs(ctx, spec: LossSpec, value, entropy, z_loss, sq) -> tuple[torch.Tensor, ...]:
    """``(value, extra, sq)``: ``extra`` the entropy (differentiable), else the z-loss
    (for logging), else empty; ``sq`` the ``sum p**2`` or empty. One
    ``mark_non_differentiable`` call (a second call would replace the first's set)."""
    extra = entropy if spec.entropy else z_loss if z_loss is not None else value.new_zeros(0)
    sq = sq if sq is not None else value.new_zeros(0)
    ctx.mark_non_differentiable(*([sq] if spec.entropy else [extra, sq]))
    return value, extra, sq


class DefaultCrossEntropy(torch.autograd.Function):
    """See the module docstring; ``spec`` is a cross-entropy ``LossSpec`` (its temperature
    is ``1 / scale``). Returns ``(value, extra, sq)``: ``extra`` the entropy with
    ``spec.entropy``, else the per-token z-loss with one, else empty; ``sq`` the
    per-token ``sum p**2`` with ``spec.sum_pi_squared``, else empty."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, shard: VocabShard, spec: LossSpec, scale):
        x, m, deriv = _shifted(logits, shard, scale, spec.softcap, tp_group)
        col = shard_columns(target, shard)
        owned = col >= 0
        picked = torch.where(owned, x.gather(-1, col.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
        e = x.exp()
        parts = [e.sum(-1), picked]
        eps = spec.label_smoothing
        if eps > 0:
            # Sum of the shifted logits over this shard's true columns (padding -> 0; a
            # -inf logit of a true id makes it -inf and the loss inf, as in torch).
            padding = torch.arange(x.shape[-1], device=x.device) >= shard.num_real
            parts.append(torch.where(padding, 0.0, x).sum(-1))
        if spec.entropy:
            parts.append(_xexp(x, e))
        if spec.sum_pi_squared:
            parts.append(e.square().sum(-1))
        del e
        stats = all_reduce_sum_(torch.stack(parts, dim=-1), tp_group)
        lse = stats[..., 0].log()
        loss = lse - stats[..., 1]
        if eps > 0:
            loss = (1.0 - eps) * loss + eps * (lse - stats[..., 2] / spec.vocab_size)
        u = stats.shape[-1] - 1 - int(spec.sum_pi_squared)
        entropy = entropy_of(stats[..., 0], stats[..., u]) if spec.entropy else None
        sq = stats[..., -1] / stats[..., 0].square() if spec.sum_pi_squared else None
        z_loss = None
        if spec.z_loss_weight != 0.0:
            z_loss = (m + lse) * (m + lse) * spec.z_loss_weight
            loss = loss + z_loss
        ignored = target == spec.ignore_index if spec.ignore_index is not None else None
        if ignored is not None:
            loss = torch.where(ignored, 0.0, loss)
            entropy = None if entropy is None else torch.where(ignored, 0.0, entropy)
            z_loss = None if z_loss is None else torch.where(ignored, 0.0, z_loss)
            sq = None if sq is None else torch.where(ignored, 0.0, sq)
        ctx.save_for_backward(logits, col, m + lse, ignored, entropy)
        ctx.args = (shard, spec, scale)
        return _outputs(ctx, spec, loss, entropy, z_loss, sq)

    @staticmethod
    def backward(ctx, grad_loss, grad_extra, grad_sq):
        forbid_double_backward("vocab_parallel_cross_entropy / vocab_parallel_logprobs")
        logits, col, shift, ignored, entropy = ctx.saved_tensors
        shard, spec, scale = ctx.args
        x, deriv = _masked_fp32(logits, shard, scale, spec.softcap)
        p = (x - shift.unsqueeze(-1)).exp()  # softmax; padding columns exp(-inf) = 0
        g = grad_loss.to(p.dtype)
        if spec.ignore_index is not None:
            g = torch.where(ignored, 0.0, g)
        w_ent = None
        if spec.entropy:
            w_ent = grad_extra.to(p.dtype) * scale
            if spec.ignore_index is not None:
                w_ent = torch.where(ignored, 0.0, w_ent)
        grad = softmax_grad_rows_(
            p,
            col,
            g * scale,
            spec,
            shard.num_real,
            weight_last=True,
            lse=shift,
            entropy=entropy,
            w_ent=w_ent,
        )
        if deriv is not None:
            grad.mul_(deriv)
        return grad.to(logits.dtype), None, None, None, None, None


class DefaultEntropy(torch.autograd.Function):
    """Per-token entropy of ``softmax(softcap(logits))`` over the true vocab (module
    docstring)."""

    @staticmethod
    def forward(ctx, logits, tp_group, shard: VocabShard, softcap=None, scale=1.0, ignored=None):
        # ignored: bool [...] (entropy and gradient 0 there) or None
        x, m, _ = _shifted(logits, shard, scale, softcap, tp_group)
        e = x.exp()
        stats = all_reduce_sum_(torch.stack([e.sum(-1), _xexp(x, e)], dim=-1), tp_group)
        entropy = entropy_of(stats[..., 0], stats[..., 1])
        ctx.save_for_backward(logits, m + stats[..., 0].log(), entropy, ignored)
        ctx.args = (shard, softcap, scale)
        return entropy if ignored is None else torch.where(ignored, 0.0, entropy)

    @staticmethod
    def backward(ctx, grad_h):
        forbid_double_backward("vocab_parallel_entropy")
        logits, shift, entropy, ignored = ctx.saved_tensors
        shard, softcap, scale = ctx.args
        x, deriv = _masked_fp32(logits, shard, scale, softcap)
        logp = x - shift.unsqueeze(-1)
        p = logp.exp()
        grad = torch.where(p > 0, p * (logp + entropy.unsqueeze(-1)), 0.0)
        g = grad_h.to(grad.dtype)
        if ignored is not None:
            g = torch.where(ignored, 0.0, g)
        grad.mul_(-g.unsqueeze(-1))
        if isinstance(scale, torch.Tensor):
            grad.mul_(scale.unsqueeze(-1))
        elif scale != 1.0:
            grad.mul_(scale)
        if deriv is not None:
            grad.mul_(deriv)
        return grad.to(logits.dtype), None, None, None, None, None


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


def _rows(v: torch.Tensor | None, r0: int, r1: int, rows: int) -> torch.Tensor | None:
    """Rows ``[r0, r1)`` of the per-token ``v``, zero padded to ``[rows // TOKEN_TILE,
    TOKEN_TILE]``."""
    return None if v is None else _pad(v[r0:r1], rows, 0.0).view(-1, TOKEN_TILE)


class InvariantLoss(torch.autograd.Function):
    """Per-token values of ``spec`` over block-aligned logits, bitwise TP-invariant.

    Returns ``(value, extra, sq)`` like ``DefaultCrossEntropy``; ``temp``: the fp32
    per-token temperature ``[N]`` (flattened tokens) or ``None``."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, layout: BlockLayout, spec: LossSpec, temp=None):
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n = x.shape[0]
        shape = (spec.num_stats, -(-n // TOKEN_TILE), TOKEN_TILE)
        parts = []
        for _, _, z, _, slots in _batches(x, t, layout, spec, temp):
            stats, _ = block_stats_(
                z, layout, slots, spec.with_sum, spec.entropy, spec.sum_pi_squared
            )
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
        rv = stats_values(root, spec)
        value, lse = rv.value.reshape(-1)[:n], rv.lse.reshape(-1)[:n]
        entropy = None if rv.entropy is None else rv.entropy.reshape(-1)[:n]
        z_loss = None if rv.z_loss is None else rv.z_loss.reshape(-1)[:n]
        sq = None if rv.sum_pi_squared is None else rv.sum_pi_squared.reshape(-1)[:n]
        if spec.ignore_index is not None:
            ignored = t == spec.ignore_index
            value = value.masked_fill(ignored, 0.0)
            entropy = None if entropy is None else entropy.masked_fill(ignored, 0.0)
            z_loss = None if z_loss is None else z_loss.masked_fill(ignored, 0.0)
            sq = None if sq is None else sq.masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, target, lse, entropy, temp)
        ctx.layout, ctx.spec = layout, spec
        value, entropy, z_loss, sq = (
            None if v is None else v.view(target.shape) for v in (value, entropy, z_loss, sq)
        )  # shaped before marking: a view of a marked output would not be marked
        return _outputs(ctx, spec, value, entropy, z_loss, sq)

    @staticmethod
    def backward(ctx, grad_value, grad_extra, grad_sq):
        forbid_double_backward("vocab_parallel_cross_entropy / logprobs (invariant=True)")
        logits, target, lse, entropy, temp = ctx.saved_tensors
        layout, spec = ctx.layout, ctx.spec
        x = logits.reshape(-1, layout.v_local)
        t = target.reshape(-1)
        n, kb = x.shape[0], layout.num_local * layout.block
        token = spec.token_weight(t, temp)
        w = token * grad_value.reshape(-1).float()
        w_ent = token * grad_extra.reshape(-1).float() if spec.entropy else None
        grad = torch.zeros_like(x)
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
            )
            if deriv is not None:
                g.mul_(deriv)
            _copy_rows(g, grad[r0:r1, :kb].unflatten(1, (-1, layout.block)), to_z=False)
        return grad.view(logits.shape), None, None, None, None, None
