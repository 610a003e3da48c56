"""Loss math with no collectives: the spec, the logit transform, row statistics, their
merge and the values (the gradient formula: ``grad``).

Logits are first transformed (``transform_logits_``): ``z = softcap(x) / T`` with
``softcap(x) = c tanh(x / c)`` (Gemma's order: cap, then temperature); fp32 throughout.
Both per-token losses are one affine form of the global statistics of ``z`` over the true
vocab of ``V`` ids: ``lse = log sum_c exp(z_c)``, ``tl = z_target``, ``sz = sum_c z_c``::

    value = a * lse + b * tl + c * sz + zw * lse**2
    d value / d z = (a + 2 zw lse) p + b onehot + c

- cross-entropy (``F.cross_entropy(label_smoothing=eps)``): ``a = 1, b = -(1 - eps),
  c = -eps / V``, plus the z-loss ``zw * lse**2`` (``z_loss_weight``; absent when 0); with
  per-class weights (``LossSpec.class_weight``) ``a``, ``b`` are per token and ``sz`` is
  the weighted sum (``class_weights``);
- log-prob ``log_softmax(z)[target]``: ``a = -1, b = 1, c = 0``;
- optionally the entropy ``H = -sum_c p_c log p_c`` of the same ``p = softmax(z)``, with
  ``d H / d z = -p (log p + H)``, and ``sum_c p_c**2`` (no gradient: a statistic).

The temperature ``T`` is a float (``LossSpec.temperature``) or a per-token tensor passed
beside the spec (``token_temperature``: fp32, one value per row of ``z``).

Tokens at ``ignore_index`` get value 0 (and entropy 0) and gradient 0.

Row statistics are one fp32 ``[S, ...]`` tensor, ``STATS`` in that order: row max ``m``,
``s = sum exp(z - m)``, the target logit (0 where the target is elsewhere), the sum of
the true logits, with entropy ``u = sum exp(z - m) (z - m)``, so ``H = log s - u / s``, and
with ``sum_pi_squared`` last ``q = sum exp(z - m)**2``, so ``sum p**2 = q / s**2``.
Partial statistics of disjoint vocab ranges merge by the online log-sum-exp
(``merge_stats``; ``q`` scales by the square of ``s``'s factor); ``stats_values`` turns
merged ones into values.

``-inf`` logits (vocabulary masks) are exact zeros of every sum: a row or block whose
logits are all ``-inf`` shifts by 0 instead of its max (``exp(-inf - -inf)`` would be
nan), so it is the merge identity ``(-inf, 0, 0, 0[, 0][, 0])``. A row whose whole true vocab
is ``-inf`` has no distribution (nan), as in torch.

Batched block form ``[T, K, TOKEN_TILE, B]`` (tile, real local block, row, column): every
op is element-wise, a reduction over the last dim, or one indexed element per row, so the
bits of a row depend on that row alone, never on T or K (which vary with the chunk and the
TP size): ATen reduces each row whole with the same inner kernel whatever the number of
rows (its threads split rows, never a row), and element-wise results do not depend on
where a kernel's vector body ends (checked for exp with 1-3 threads on this build,
``tests/unit/test_vocab_blocks.py``; tanh of the soft-cap and log of the entropy by the
bitwise TP / chunk / batch tests of ``tests/functional/test_rl_head_options.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mp_bridge.layers.loss.blocks import TOKEN_TILE, BlockLayout, TargetSlots
from mp_bridge.layers.loss.class_weights import token_coefficients
from mp_bridge.layers.loss.outputs import TokenOutputs

__all__ = [
    "STATS",
    "LossSpec",
    "block_stats_",
    "combine_stats",
    "entropy_of",
    "exp_shift_",
    "merge_stats",
    "row_stats_",
    "safe_shift",
    "softcap_",
    "stats_values",
    "transform_logits_",
]

STATS = ("max", "sumexp", "target", "sum", "xexp", "sqexp")
_INF = float("inf")


@dataclass(frozen=True)
class LossSpec:
    """Which per-token quantities to compute, and their constants."""

    kind: str  # "ce" | "logprob"
    vocab_size: int
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    temperature: float = 1.0
    softcap: float | None = None
    z_loss_weight: float = 0.0
    entropy: bool = False  # also the per-token entropy (a second output)
    sum_pi_squared: bool = False  # also sum_c p_c**2 per token (last output, no gradient)
    # ce_weight [V] (class_weights): not in the repr, the ranks agree on its bits instead
    class_weight: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def cross_entropy(
        cls,
        vocab_size: int,
        ignore_index: int | None,
        label_smoothing: float,
        *,
        temperature: float = 1.0,
        softcap: float | None = None,
        z_loss_weight: float = 0.0,
        class_weight: torch.Tensor | None = None,
    ) -> LossSpec:
        return cls(
            "ce",
            vocab_size,
            ignore_index,
            float(label_smoothing),
            float(temperature),
            softcap,
            float(z_loss_weight),
            class_weight=class_weight,
        )

    @classmethod
    def logprob(
        cls,
        vocab_size: int,
        temperature: float,
        *,
        ignore_index: int | None = None,
        softcap: float | None = None,
        entropy: bool = False,
        sum_pi_squared: bool = False,
    ) -> LossSpec:
        return cls(
            "logprob",
            vocab_size,
            ignore_index,
            0.0,
            float(temperature),
            softcap,
            0.0,
            entropy,
            sum_pi_squared,
        )

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

    @property
    def num_stats(self) -> int:
        """``S``: statistics per row (4, one more with entropy, one more with ``q``)."""
        return 4 + int(self.entropy) + int(self.sum_pi_squared)

    def merge(self, stats: torch.Tensor, dim: int) -> torch.Tensor:
        """``merge_stats`` of this spec's statistics."""
        return merge_stats(stats, dim, sum_pi_squared=self.sum_pi_squared)

    def combine(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``combine_stats`` of this spec's statistics."""
        return combine_stats(x, y, sum_pi_squared=self.sum_pi_squared)

    @property
    def plain(self) -> bool:
        """No z-loss, entropy or class weights: the gradient is the affine form alone."""
        return self.z_loss_weight == 0.0 and not self.entropy and self.class_weight is None

    def zero_outputs(self, n: int, device: torch.device) -> TokenOutputs:
        """fp32 zeros ``[n]`` for every per-token output this spec computes, ``lse``
        included (the others ``None``)."""

        def zeros(wanted: bool = True) -> torch.Tensor | None:
            return torch.zeros(n, dtype=torch.float32, device=device) if wanted else None

        z_loss = self.z_loss_weight != 0.0
        return TokenOutputs(
            zeros(), zeros(self.entropy), zeros(z_loss), zeros(self.sum_pi_squared), zeros()
        )

    def temperatures(
        self, token_temperature: torch.Tensor | None, n: int, device: torch.device
    ) -> torch.Tensor:
        """``T`` per token, fp32 ``[n]``: ``token_temperature`` (already flat fp32, from the
        parse), else the spec's float (for kernels that read one per row)."""
        if token_temperature is not None:
            return token_temperature
        return torch.full((n,), self.temperature, dtype=torch.float32, device=device)

    def token_weight(
        self,
        target: torch.Tensor,
        token_temperature: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Per-token factor of ``d value / d logits`` in ``dtype``: ``1 / T``, 0 on ignored
        tokens.

        ``token_temperature``: ``T`` per token (shaped like ``target``), else the spec's
        float."""
        if token_temperature is not None:
            w = token_temperature.to(dtype).reciprocal()
        else:
            w = torch.full(target.shape, 1.0 / self.temperature, dtype=dtype, device=target.device)
        if self.ignore_index is not None:
            w = w.masked_fill(target == self.ignore_index, 0.0)
        return w


# ------------------------------------------------------------------ logit transform
def softcap_(z: torch.Tensor, cap: float) -> torch.Tensor:
    """``z <- cap * tanh(z / cap)`` in place; returns ``d/dz = 1 - tanh(z / cap)**2``.

    ``-inf`` becomes ``-cap`` (a soft cap keeps no hard mask), with derivative 0.
    """
    t = z.div_(cap).tanh_()
    deriv = torch.mul(t, t).neg_().add_(1.0)
    t.mul_(cap)
    return deriv


def transform_logits_(
    z: torch.Tensor, spec: LossSpec, token_temperature: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``z <- softcap(z) / T`` in place; returns the soft-cap derivative (``None``: no cap).

    ``T``: ``token_temperature`` (fp32, broadcastable to ``z``: one value per row), else
    ``spec.temperature``. ``1 / T`` is part of the per-token factor
    (``LossSpec.token_weight``), not of the returned derivative.
    """
    deriv = softcap_(z, spec.softcap) if spec.softcap is not None else None
    if token_temperature is not None:
        z.div_(token_temperature)
    elif spec.temperature != 1.0:
        z.div_(spec.temperature)
    return deriv


# ------------------------------------------------------------------ statistics
def safe_shift(m: torch.Tensor) -> torch.Tensor:
    """The shift of ``exp(z - shift)``: ``m``, or 0 where ``m = -inf`` (then ``exp`` = 0)."""
    return m.masked_fill(m == -_INF, 0.0)


def merge_stats(stats: torch.Tensor, dim: int, *, sum_pi_squared: bool = False) -> torch.Tensor:
    """Online log-sum-exp merge of the partials along ``dim`` of ``stats [S, ...]``.

    Partials lie in vocab order along ``dim``; the result drops ``dim``. An all-padding
    (or all ``-inf``) partial ``(-inf, 0, 0, 0[, 0][, 0])`` is an exact no-op. The
    entropy's ``u`` is present when ``S`` is 5 without ``q`` or 6 with it;
    ``sum_pi_squared``: the last row is ``q``.
    """
    d = dim - 1  # the dim inside one statistic
    m = stats[0].amax(dim=d)
    diff = stats[0] - safe_shift(m).unsqueeze(d)
    scale = torch.exp(diff)
    out = [m, (stats[1] * scale).sum(dim=d), stats[2].sum(dim=d), stats[3].sum(dim=d)]
    if stats.shape[0] - int(sum_pi_squared) == 5:  # u_i by m_i -> by m: scale (u_i + diff s_i)
        moved = torch.where(stats[1] > 0, diff * stats[1], 0.0)
        out.append(((stats[4] + moved) * scale).sum(dim=d))
    if sum_pi_squared:  # q_i = sum exp(z - m_i)**2 -> by m: scale**2 q_i
        out.append((stats[-1] * (scale * scale)).sum(dim=d))
    return torch.stack(out)


def combine_stats(
    x: torch.Tensor, y: torch.Tensor, *, sum_pi_squared: bool = False
) -> torch.Tensor:
    """``merge_stats`` of two ``[S, ...]`` partials (``x`` left of ``y`` in vocab order)."""
    return merge_stats(torch.stack([x, y], dim=1), 1, sum_pi_squared=sum_pi_squared)


def entropy_of(s: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``H = log s - u / s`` from ``s = sum exp(z - m)``, ``u = sum exp(z - m) (z - m)``."""
    return torch.log(s) - u / s


def stats_values(
    root: torch.Tensor, spec: LossSpec, *, relative: bool = False, omega=None
) -> TokenOutputs:
    """The per-token outputs (value with its z-loss, entropy, z-loss, ``sum_pi_squared``,
    and ``lse``) of merged ``[S, ...]`` stats, unmasked.

    ``relative``: the target logit and the sum hold ``z - m`` (``row_stats_(shift=)``), so
    ``value = a log s + b tl + c sz`` (``a + b + c V = 0``: the shift cancels) skips the
    rounding of ``lse = m + log s`` in ``lse - z_t``. ``omega``: the tokens' class weights
    (``class_weights.target_weights``) with ``spec.class_weight``.
    """
    a, b, c = token_coefficients(spec, omega)
    log_s = torch.log(root[1])
    lse = root[0] + log_s
    value = (log_s if relative else lse) * a + root[2] * b
    if c != 0.0:
        value = value + root[3] * c
    z_loss = None
    if spec.z_loss_weight != 0.0:
        z_loss = lse * lse * spec.z_loss_weight
        value = value + z_loss
    entropy = entropy_of(root[1], root[4]) if spec.entropy else None
    sq = root[-1] / (root[1] * root[1]) if spec.sum_pi_squared else None
    return TokenOutputs(value, entropy, z_loss, sq, lse)


def _xexp(e: torch.Tensor) -> torch.Tensor:
    """``sum exp(x) x`` over the last dim from ``e = exp(x)`` (``0 log 0 = 0`` at ``-inf``)."""
    return torch.special.xlogy(e, e).sum(dim=-1)


def row_stats_(
    z: torch.Tensor,
    col: torch.Tensor,
    valid: int,
    spec: LossSpec,
    *,
    shift: torch.Tensor | None = None,
    colw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, C]`` statistics of transformed fp32 logits ``z [C, V_local]`` and the row max
    (those ``spec`` asks for: ``STATS``, ``LossSpec.num_stats``).

    ``valid`` true columns (the rest is padding, set to -inf); ``col`` the local target
    column or -1. ``z`` is left holding ``exp(z - m)`` (no second ``[C, V_local]``
    buffer); a shard of padding only gives the merge identity and ``z = 0``. ``shift``:
    a row max ``m [C]`` taken over more columns than these (all TP shards; ``-inf`` where
    the row is all ``-inf``) to use instead of this shard's own; the target logit and the
    sum are then of ``z - m`` (``stats_values(relative=True)``). ``colw [V_local]``: the
    columns' class weights (the sum is then weighted).
    """
    if valid < z.shape[1]:
        z[:, valid:] = -_INF
    m = shift
    if m is not None:
        z.sub_(safe_shift(m).unsqueeze(1))
    tl = torch.where(col >= 0, z.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    sz = torch.zeros_like(tl)
    if spec.with_sum and valid:  # weighted: one matrix-vector product, no [C, V] temporary
        sz = z[:, :valid].sum(dim=1) if colw is None else torch.mv(z[:, :valid], colw[:valid])
    if m is None and valid:
        m = z.amax(dim=1)
        z.sub_(safe_shift(m).unsqueeze(1))
    if m is None:
        m, s = torch.full_like(tl, -_INF), torch.zeros_like(tl)
        z.zero_()
    else:
        s = z.exp_().sum(dim=1)
    parts = [m, s, tl, sz]
    if spec.entropy:
        parts.append(_xexp(z))
    if spec.sum_pi_squared:
        parts.append(z.square().sum(dim=1))
    return torch.stack(parts), m


def exp_shift_(z: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Mask the padding columns of ``z [T, K, TOKEN_TILE, B]`` to -inf, then ``z <- exp(z -
    m)`` in place, ``m [T, K, TOKEN_TILE]`` the max of each block row (returned; ``-inf``
    for an all ``-inf`` block row, which then holds zeros)."""
    k = z.shape[1]
    if k and layout.tail < layout.block:
        z[:, k - 1, :, layout.tail :] = -_INF
    m = z.amax(dim=-1)
    z.sub_(safe_shift(m).unsqueeze(-1)).exp_()  # padding columns: exp(-inf) = 0
    return m


def block_stats_(
    z: torch.Tensor, layout: BlockLayout, slots: TargetSlots, spec: LossSpec, colw=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, T, K, TOKEN_TILE]`` statistics of every (tile, block) row (those ``spec``
    asks for), and ``m``.

    ``z`` (transformed fp32 logits) is left holding ``exp(z - m)`` (``exp_shift_``). With
    ``K == 0`` the partials are all zero and are never folded (no pieces). ``colw [K,
    B]``: the columns' class weights (the sum is then weighted).
    """
    t, k = z.shape[:2]
    stats = z.new_zeros((spec.num_stats, t, k, TOKEN_TILE))
    if k == 0:
        return stats, stats[0]
    tile, blk, row, col = slots.index
    stats[2].index_put_((tile, blk, row), z[tile, blk, row, col])
    if spec.with_sum:
        tail = layout.tail
        full, last = z[:, : k - 1], z[:, k - 1, :, :tail]
        if colw is not None:
            full, last = full * colw[: k - 1].unsqueeze(1), last * colw[k - 1, :tail]
        stats[3, :, : k - 1] = full.sum(dim=-1)
        stats[3, :, k - 1] = last.sum(dim=-1)
    m = exp_shift_(z, layout)
    stats[0] = m
    stats[1] = z.sum(dim=-1)
    if spec.entropy:
        stats[4] = _xexp(z)
    if spec.sum_pi_squared:
        stats[-1] = z.square().sum(dim=-1)
    return stats, m
