"""Per-class cross-entropy weights (``ce_weight``, torch's ``F.cross_entropy(weight=)``) on
the affine form of ``formulas``. No collectives.

With ``w [V]`` the class weights (``LossSpec.class_weight``, identical on every rank),
``omega = w[target]`` per token (0 at ``ignore_index``), ``W = sum_c w_c`` and smoothing
``eps``, the cross-entropy of one token is torch's::

    value = (1 - eps) omega (lse - z_t) + eps / V sum_c w_c (lse - z_c)  [+ zw lse**2]
          = a lse + b z_t + c sum_c w_c z_c  [+ zw lse**2]
    a = (1 - eps) omega + eps W / V,   b = -(1 - eps) omega,   c = -eps / V
    d value / d z_j = (a + 2 zw lse) p_j + b onehot_j + c w_j

so the per-token coefficients ``a``, ``b`` come from ``token_coefficients``, the statistic
``sum`` becomes the weighted ``sum_c w_c z_c`` (``column_weights`` of this shard's columns,
0 on padding), and the z-loss stays unweighted. ``reduction="mean"`` divides the weighted
cross-entropy by the sum of ``omega`` over the ``n`` counted tokens, as torch does,
smoothing or not, and the z-loss by ``n`` (as Liger-Kernel: it stays unweighted): the parse
scales the weights by ``n / sum omega`` (``mean_scaled``), then every path takes its usual
mean over ``n``.

Each function takes the ``formulas.LossSpec`` (not imported here: ``formulas`` imports
this module). Without class weights they return ``None`` / the spec's float
coefficients, so the unweighted math keeps its bits.
"""

from __future__ import annotations

import torch

__all__ = ["column_weights", "mean_scaled", "target_weights", "token_coefficients"]


def target_weights(spec, target: torch.Tensor) -> torch.Tensor | None:
    """``omega = w[target]`` per token (the dtype of ``w``), 0 where the target is
    ``ignore_index`` or no class (placeholder ids ``-1``); ``None`` without class weights."""
    w = spec.class_weight
    if w is None:
        return None
    real = (target >= 0) & (target < spec.vocab_size)
    if spec.ignore_index is not None:
        real &= target != spec.ignore_index
    omega = w[target.clamp(0, spec.vocab_size - 1)]
    return torch.where(real, omega, torch.zeros((), dtype=w.dtype, device=w.device))


def mean_scaled(
    weight: torch.Tensor, target: torch.Tensor, ignore_index: int | None
) -> torch.Tensor:
    """``weight * n / sum omega`` for ``reduction="mean"`` (no host sync): ``n`` counted
    tokens (not at ``ignore_index``), ``omega = weight[target]`` theirs. With ``sum omega =
    0`` the scale is nan if a token counts (torch's ``0 / 0``: nan values and gradients),
    else 1 (no token counts: the usual nan mean with zero gradients)."""
    counted = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        counted = target != ignore_index
    omega = torch.where(counted, weight[torch.where(counted, target, 0)], 0.0)
    total, n = omega.sum(), counted.sum().to(weight.dtype)
    idle = torch.where(n > 0, torch.full_like(n, float("nan")), 1.0)
    scale = torch.where(total > 0, n / torch.where(total > 0, total, 1.0), idle)
    return weight * scale


def column_weights(spec, start: int, size: int) -> torch.Tensor | None:
    """The class weights of global columns ``[start, start + size)``, ``[size]``, 0 past the
    true vocab (padding); ``None`` without class weights."""
    w = spec.class_weight
    if w is None:
        return None
    part = w[start : start + size]
    if part.shape[0] == size:
        return part
    out = w.new_zeros(size)
    out[: part.shape[0]] = part
    return out


def token_coefficients(spec, omega: torch.Tensor | None):
    """``(a, b, c)`` of the module docstring: per-token tensors ``a``, ``b`` shaped like
    ``omega`` with class weights, else the spec's floats (``LossSpec.coefficients``)."""
    a, b, c = spec.coefficients
    if omega is None or spec.class_weight is None:
        return a, b, c
    eps = spec.label_smoothing
    total = spec.class_weight.sum()
    return omega * (1.0 - eps) + total * (eps / spec.vocab_size), omega * -(1.0 - eps), c
