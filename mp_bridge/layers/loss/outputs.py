"""The outputs of the loss APIs: ``reduction`` over tokens and the returned tuple.

Every loss API returns its per-token outputs ``[...]`` (``reduction="none"``) or reduces
each of them the same way: ``"sum"`` over all tokens, ``"mean"`` over the counted tokens
(those whose target is not ``ignore_index``; all tokens without targets), like
``F.cross_entropy``. A mean over no counted token is nan with zero gradients (no nan
gradient leaks into the logits). Outputs are returned in a fixed order, the first alone
when nothing else was asked for: value (loss or log-probs), entropy, ``sum_pi_squared``
(log-probs), or loss, z-loss (cross-entropy). No collective: the reduction is local to
this rank's tokens (combine across DP / CP with ``masked_mean``).
"""

from __future__ import annotations

import torch

__all__ = ["counted_tokens", "reduce_tokens", "returned"]


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
