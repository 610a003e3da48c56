"""The outputs of the loss APIs: ``reduction`` over tokens and the returned tuple.

Every loss API returns its per-token outputs ``[...]`` (``reduction="none"``) or reduces
each of them the same way: ``"sum"`` over all tokens, ``"mean"`` over the counted tokens
(those whose target is not ``ignore_index``; all tokens without targets), like
``F.cross_entropy``. A mean over no counted token is nan with zero gradients (no nan
gradient leaks into the logits). Outputs are returned in a fixed order, the first alone
when nothing else was asked for: value (loss or log-probs), entropy, ``sum_pi_squared``
(log-probs), or loss, z-loss (cross-entropy). No collective: the reduction is local to
this rank's tokens (combine across DP / CP with ``masked_mean``).

Per-token results travel as one record, :class:`TokenOutputs`, from the formulas
(``formulas.stats_values``) through both engines' autograd Functions to the door
(``LossOptions.returned``); a Function returns ``record.tensors()`` and its caller reads
``TokenOutputs(*outputs)`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["TokenOutputs", "counted_tokens", "reduce_tokens", "returned"]


class TokenOutputs(NamedTuple):
    """The per-token outputs of one loss call, each fp32 ``[N]`` (the token shape at the
    door), or 0-dim where a fused cross-entropy reduced them; ``None`` when not computed.

    ``value``: the loss (cross-entropy, z-loss included) or the log-prob; differentiable.
    ``entropy``: with ``spec.entropy``; differentiable.
    ``z_loss``: ``z_loss_weight * lse**2`` with ``spec.z_loss_weight != 0``; no gradient
    (logging: its gradient is already in ``value``).
    ``sum_pi_squared``: ``sum_c p_c**2`` with ``spec.sum_pi_squared``; no gradient.
    ``lse``: the log-sum-exp of the logits, which an engine keeps for backward; ``None``
    in what an engine returns.

    A new per-token output is one more field here, its statistic in ``formulas`` and its
    place in ``LossOptions.returned``.
    """

    value: torch.Tensor
    entropy: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TokenOutputs:
        """``fn`` of every present field."""
        return TokenOutputs(*(None if t is None else fn(t) for t in self))

    def masked(self, ignored: torch.Tensor | None) -> TokenOutputs:
        """0 at the ``ignored`` tokens (bool, shaped like the fields; ``None``: none) on
        every output; ``lse`` as it is."""
        if ignored is None:
            return self
        return self.map(lambda t: t.masked_fill(ignored, 0.0))._replace(lse=self.lse)

    def tensors(self, ctx) -> tuple[torch.Tensor | None, ...]:
        """What an autograd Function returns: the fields but ``lse``, with the z-loss and
        ``sum_pi_squared`` marked non-differentiable on ``ctx`` (one call: a second one
        would replace the first's set)."""
        logged = (t for t in (self.z_loss, self.sum_pi_squared) if t is not None)
        ctx.mark_non_differentiable(*logged)
        return tuple(self[:4])


def counted_tokens(target: torch.Tensor | None, ignore_index: int | None) -> torch.Tensor | None:
    """Bool mask of the tokens a mean counts (``None``: all of them)."""
    if target is None or ignore_index is None:
        return None
    return target != ignore_index


def reduce_tokens(
    value: torch.Tensor, counted: torch.Tensor | None, reduction: str
) -> torch.Tensor:
    """``value [...]`` (0 at ignored tokens) reduced by ``reduction`` (no host sync)."""
    if reduction == "none":
        return value
    total = value.sum()
    if reduction == "sum":
        return total
    count = value.new_tensor(value.numel()) if counted is None else counted.sum().to(total)
    # Divide by max(count, 1) so the gradient is 0, not nan, when nothing counts; the
    # value itself is nan then, like F.cross_entropy.
    mean = total / count.clamp(min=1)
    return torch.where(count > 0, mean, torch.full_like(mean, float("nan")))


def returned(outputs: list[torch.Tensor | None], counted, reduction: str):
    """The requested outputs (``None`` = not requested), reduced: one tensor or a tuple."""
    out = tuple(reduce_tokens(o, counted, reduction) for o in outputs if o is not None)
    return out[0] if len(out) == 1 else out
