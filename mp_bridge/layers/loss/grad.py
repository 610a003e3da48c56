"""The softmax -> gradient formula of every loss path, in row and batched block form.

No collectives. The math is in ``formulas``'s docstring: ``d value / d z = (a + 2 zw
lse) p + b onehot + c`` and ``d H / d z = -p (log p + H)``, ``p = softmax(z)``; the
soft-cap and ``1 / T`` factors of ``d z / d logits`` are applied by the callers. With
class weights (``class_weights``) ``a``, ``b`` are per token (``omega``) and ``c`` is ``c
w_j`` per column (``colw``), always on the general path. Block
form: every op is element-wise or one indexed element per row (``formulas``), so a row's
bits depend on that row alone.
"""

from __future__ import annotations

import torch

from mp_bridge.layers.loss.blocks import BlockLayout, TargetSlots
from mp_bridge.layers.loss.class_weights import token_coefficients
from mp_bridge.layers.loss.formulas import LossSpec

__all__ = ["softmax_grad_blocks_", "softmax_grad_rows_"]


def _row_factor(w, a, spec: LossSpec, lse, entropy, w_ent) -> torch.Tensor:
    """Per-row factor of ``p`` in the gradient: ``(a + 2 zw lse) w - w_ent H``."""
    k = w * a
    if spec.z_loss_weight != 0.0:
        k = k + w * lse * (2.0 * spec.z_loss_weight)
    if spec.entropy:
        k = k - w_ent * entropy
    return k


def softmax_grad_rows_(
    p: torch.Tensor,
    col: torch.Tensor,
    w: torch.Tensor,
    spec: LossSpec,
    valid: int,
    *,
    weight_last: bool = False,
    lse: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    w_ent: torch.Tensor | None = None,
    omega: torch.Tensor | None = None,
    colw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row form: ``p [..., V_local]`` holds the softmax (0 on padding) -> the gradient.

    Returns ``w * d value / d z + w_ent * d H / d z``. ``col [...]``: local target column
    or -1; ``w``, ``w_ent [...]``: per-token factors (``w_ent``, ``entropy``: with
    ``spec.entropy``; ``lse``: with a z-loss); ``valid``: true columns. Without z-loss and
    entropy, one formula in two evaluation orders, each part of its path's bits: default
    ``(a p + c) w + (w b) onehot`` (fused and invariant paths); ``weight_last`` ``((a p +
    b onehot) + c) w`` (the materialized path, Megatron's order). With them: ``p k + c w
    - w_ent p log p + (w b) onehot``, ``k`` the per-row factor of ``_row_factor``.
    ``omega [...]``, ``colw [V_local]``: the class weights of the tokens and columns.
    """
    a, b, c = token_coefficients(spec, omega)
    index = col.clamp(min=0).unsqueeze(-1)  # rows whose target is elsewhere add an exact 0
    if not spec.plain:
        plogp = torch.special.xlogy(p, p) if spec.entropy else None
        p.mul_(_row_factor(w, a, spec, lse, entropy, w_ent).unsqueeze(-1))
        if c != 0.0 and valid > 0:
            wc = (w * c).unsqueeze(-1)
            p[..., :valid].add_(wc if colw is None else wc * colw[:valid])
        if plogp is not None:
            p.sub_(plogp.mul_(w_ent.unsqueeze(-1)))
        return p.scatter_add_(-1, index, torch.where(col >= 0, w * b, 0.0).unsqueeze(-1))
    if a != 1.0:
        p.mul_(a)
    if weight_last:  # b made in p's dtype: an fp32 b = -(1 - eps) would round fp64 rows
        onehot_b = p.new_zeros(col.shape).masked_fill_(col >= 0, b)
        p.scatter_add_(-1, index, onehot_b.unsqueeze(-1))
    if c != 0.0 and valid > 0:
        p[..., :valid].add_(c)
    p.mul_(w.unsqueeze(-1))
    if not weight_last:
        p.scatter_add_(-1, index, torch.where(col >= 0, w * b, 0.0).unsqueeze(-1))
    return p


def softmax_grad_blocks_(
    e: torch.Tensor,
    m: torch.Tensor,
    lse: torch.Tensor,
    w: torch.Tensor,
    slots: TargetSlots,
    layout: BlockLayout,
    spec: LossSpec,
    *,
    entropy: torch.Tensor | None = None,
    w_ent: torch.Tensor | None = None,
    omega: torch.Tensor | None = None,
    colw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched form: ``e = exp(z - m) [T, K, TOKEN_TILE, B]`` -> the gradient, in place.

    ``lse``, ``w`` (and ``entropy``, ``w_ent``): ``[T, TOKEN_TILE]`` (``w``, ``w_ent`` 0
    on ignored or padded rows). The orders of ``softmax_grad_rows_``: ``(a softmax + c)
    w`` on true columns, plus ``w b`` at the target (0 on padding columns); with z-loss or
    entropy ``p k + c w - w_ent p log p``. ``omega [T, TOKEN_TILE]``, ``colw [K, B]``: the
    class weights of the tokens and columns.
    """
    k = e.shape[1]
    if k == 0:
        return e
    a, b, c = token_coefficients(spec, omega)
    e.mul_(torch.exp(m - lse.unsqueeze(1)).unsqueeze(-1))  # softmax = exp(z - m) exp(m - lse)
    if spec.plain:
        if a != 1.0:
            e.mul_(a)
        if c != 0.0:
            e.add_(c)
    else:
        plogp = torch.special.xlogy(e, e) if spec.entropy else None
        e.mul_(_row_factor(w, a, spec, lse, entropy, w_ent).unsqueeze(1).unsqueeze(-1))
        if c != 0.0:
            wc = (w * c).unsqueeze(1).unsqueeze(-1)
            e.add_(wc if colw is None else wc * colw.unsqueeze(1))
        if plogp is not None:
            e.sub_(plogp.mul_(w_ent.unsqueeze(1).unsqueeze(-1)))
    if c != 0.0 and layout.tail < layout.block:
        e[:, k - 1, :, layout.tail :] = 0.0
    if spec.plain:
        e.mul_(w.unsqueeze(1).unsqueeze(-1))
    if slots.pos.numel():
        wb = w.reshape(-1)[slots.pos] * b if omega is None else (w * b).reshape(-1)[slots.pos]
        e.index_put_(slots.index, e[slots.index] + wb)
    return e
