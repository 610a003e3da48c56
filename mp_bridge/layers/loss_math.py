"""Loss math with no collectives: the spec, per-row statistics, their merge, the gradient.

Both per-token losses are one affine form of the global statistics of ``z`` (fp32
logits, already divided by the temperature), over the true vocab of ``V`` ids:
``lse = log sum_c exp(z_c)``, ``tl = z_target``, ``sz = sum_c z_c``::

    value = a * lse + b * tl + c * sz         d value / d z = a * softmax(z) + b * onehot + c

- cross-entropy (``F.cross_entropy(label_smoothing=eps)``): ``a = 1, b = -(1 - eps),
  c = -eps / V``; ignored tokens get value 0 and gradient 0.
- log-prob ``log_softmax(z)[target]``: ``a = -1, b = 1, c = 0``.

Row statistics are one fp32 ``[4, ...]`` tensor, ``STATS`` in that order: row max ``m``,
``s = sum exp(z - m)``, the target logit (0 where the target is elsewhere) and the sum of
the true logits. Partial statistics of disjoint vocab ranges merge by the online
log-sum-exp (``merge_stats``); ``stats_values`` turns merged ones into values and lse.

Batched block form ``[T, K, TOKEN_TILE, B]`` (tile, real local block, row, column): every
op is element-wise, a reduction over the last dim, or one indexed element per row, so the
bits of a row depend on that row alone, never on T or K (which vary with the chunk and the
TP size): ATen reduces each row whole with the same inner kernel whatever the number of
rows (its threads split rows, never a row), and element-wise results do not depend on
where a kernel's vector body ends (checked for exp, the only transcendental, with 1-3
threads on this build; ``tests/unit/test_vocab_blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .loss_blocks import TOKEN_TILE, BlockLayout, TargetSlots

__all__ = [
    "STATS",
    "LossSpec",
    "block_stats_",
    "combine_stats",
    "exp_shift_",
    "merge_stats",
    "row_stats_",
    "softmax_grad_blocks_",
    "softmax_grad_rows_",
    "stats_values",
]

STATS = ("max", "sumexp", "target", "sum")


@dataclass(frozen=True)
class LossSpec:
    """Which per-token quantity to compute, and its constants."""

    kind: str  # "ce" | "logprob"
    vocab_size: int
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    temperature: float = 1.0

    @classmethod
    def cross_entropy(cls, vocab_size: int, ignore_index: int, label_smoothing: float):
        return cls("ce", vocab_size, ignore_index, float(label_smoothing))

    @classmethod
    def logprob(cls, vocab_size: int, temperature: float):
        return cls("logprob", vocab_size, None, 0.0, float(temperature))

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` of the affine form in the module docstring."""
        if self.kind == "ce":
            eps = self.label_smoothing
            return 1.0, -(1.0 - eps), -eps / self.vocab_size
        return -1.0, 1.0, 0.0

    @property
    def with_sum(self) -> bool:
        """Whether the value needs ``sz``, the sum of the logits."""
        return self.coefficients[2] != 0.0

    def token_weight(self, target: torch.Tensor) -> torch.Tensor:
        """fp32 per-token factor of ``d value / d logits``: ``1 / T``, 0 on ignored tokens."""
        w = torch.full(
            target.shape, 1.0 / self.temperature, dtype=torch.float32, device=target.device
        )
        if self.ignore_index is not None:
            w = w.masked_fill(target == self.ignore_index, 0.0)
        return w


# ------------------------------------------------------------------ statistics
def merge_stats(stats: torch.Tensor, dim: int) -> torch.Tensor:
    """Online log-sum-exp merge of the partials along ``dim`` of ``stats [4, ...]``.

    Partials lie in vocab order along ``dim``; the result drops ``dim``. An all-padding
    partial ``(-inf, 0, 0, 0)`` is an exact no-op (``exp(-inf - m) = 0``).
    """
    d = dim - 1  # the dim inside one statistic
    m = stats[0].amax(dim=d)
    s = (stats[1] * torch.exp(stats[0] - m.unsqueeze(d))).sum(dim=d)
    return torch.stack([m, s, stats[2].sum(dim=d), stats[3].sum(dim=d)])


def combine_stats(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``merge_stats`` of two ``[4, ...]`` partials (``x`` left of ``y`` in vocab order)."""
    return merge_stats(torch.stack([x, y], dim=1), 1)


def stats_values(root: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, lse)`` per token from merged ``[4, ...]`` stats (affine form of LossSpec)."""
    a, b, c = spec.coefficients
    lse = root[0] + torch.log(root[1])
    value = lse * a + root[2] * b
    if c != 0.0:
        value = value + root[3] * c
    return value, lse


def row_stats_(
    z: torch.Tensor, col: torch.Tensor, valid: int, with_sum: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[4, C]`` statistics of raw fp32 logits ``z [C, V_local]`` and the row max ``m``.

    ``valid`` true columns (the rest is padding, set to -inf); ``col`` the local target
    column or -1. ``z`` is left holding ``exp(z - m)`` (no second ``[C, V_local]``
    buffer); a shard of padding only gives the merge identity and ``z = 0``.
    """
    if valid < z.shape[1]:
        z[:, valid:] = float("-inf")
    tl = torch.where(col >= 0, z.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    sz = z[:, :valid].sum(dim=1) if with_sum and valid else torch.zeros_like(tl)
    if valid:
        m = z.amax(dim=1)
        s = z.sub_(m.unsqueeze(1)).exp_().sum(dim=1)
    else:
        m, s = torch.full_like(tl, float("-inf")), torch.zeros_like(tl)
        z.zero_()
    return torch.stack([m, s, tl, sz]), m


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
    """``[4, T, K, TOKEN_TILE]`` statistics of every (tile, block) row, and ``m``.

    ``z`` (raw fp32 logits) is left holding ``exp(z - m)`` (``exp_shift_``). With
    ``K == 0`` the partials are all zero and are never folded (no pieces).
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


# ------------------------------------------------------------------ softmax -> gradient
def softmax_grad_rows_(
    p: torch.Tensor,
    col: torch.Tensor,
    w: torch.Tensor,
    spec: LossSpec,
    valid: int,
    *,
    weight_last: bool = False,
) -> torch.Tensor:
    """Row form: ``p [..., V_local]`` holds the softmax (0 on padding) -> ``w * d value / d z``.

    ``col [...]``: local target column or -1; ``w [...]``: per-token factor; ``valid``:
    true columns. One formula, two evaluation orders, each part of its path's bits:
    default ``(a p + c) w + (w b) onehot`` (fused and invariant paths); ``weight_last``
    ``((a p + b onehot) + c) w`` (the materialized path, Megatron's order).
    """
    a, b, c = spec.coefficients
    if a != 1.0:
        p.mul_(a)
    index = col.clamp(min=0).unsqueeze(-1)  # rows whose target is elsewhere add an exact 0
    if weight_last:
        p.scatter_add_(-1, index, torch.where(col >= 0, b, 0.0).to(p.dtype).unsqueeze(-1))
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
) -> torch.Tensor:
    """Batched form: ``e = exp(z - m) [T, K, TOKEN_TILE, B]`` -> ``w * d value / d z`` in place.

    ``lse``, ``w``: ``[T, TOKEN_TILE]`` (``w`` 0 on ignored or padded rows). The order of
    ``softmax_grad_rows_``: ``(a softmax + c) w`` on true columns, plus ``w b`` at the
    target; 0 on padding columns.
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
