"""``tokens_per_sample``: one rank's per-sample token counts, parsed once (pure).

The ragged bridge (``communicate_ragged``) and ``route`` take the sample-major tokens
``x`` ``[T, *rest]`` of a rank's encoder batch with one count per sample (zeros allowed,
summing to ``T``). :func:`check_tokens_per_sample` validates that argument locally, before
any collective, and returns it as a tuple of ints; everything after it trusts the tuple.

Example: ``check_tokens_per_sample(torch.tensor([3, 0, 2]), 5) == (3, 0, 2)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_bridge.checks import is_int

__all__ = ["check_tokens_per_sample"]


def check_tokens_per_sample(tokens_per_sample: object, num_tokens: int) -> tuple[int, ...]:
    """Validate ``tokens_per_sample`` (local, no collective) and return it as ints.

    Accepts a 1-D integer tensor or a sequence of ints, each >= 0, summing to ``num_tokens``
    (the first dim of ``x``). Raises ``ValueError`` naming the value and the fix.
    """
    if isinstance(tokens_per_sample, torch.Tensor):
        t = tokens_per_sample
        if t.dim() != 1:
            raise ValueError(
                f"tokens_per_sample has shape {tuple(t.shape)} ({t.dim()} dims); pass a 1-D "
                f"tensor with one token count per sample of this rank's batch"
            )
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ValueError(
                f"tokens_per_sample has dtype {t.dtype}; pass an integer tensor (e.g. "
                f"torch.int64) of per-sample token counts"
            )
        values = t.tolist()
    elif isinstance(tokens_per_sample, Sequence) and not isinstance(tokens_per_sample, str):
        values = list(tokens_per_sample)
        bad = [v for v in values if not is_int(v)]
        if bad:
            raise ValueError(
                f"tokens_per_sample={values} has non-int entries {bad[:4]}; pass a flat "
                f"sequence (or 1-D integer tensor) of per-sample token counts"
            )
    else:
        raise TypeError(
            f"tokens_per_sample must be a 1-D integer tensor or a sequence of ints, got "
            f"{type(tokens_per_sample).__name__}"
        )
    negative = [v for v in values if v < 0]
    if negative:
        raise ValueError(
            f"tokens_per_sample={_short(values)} has negative counts {negative[:4]}; each "
            f"sample's token count must be >= 0 (0 for a text-only sample)"
        )
    if sum(values) != num_tokens:
        raise ValueError(
            f"tokens_per_sample={_short(values)} sums to {sum(values)} but x has {num_tokens} "
            f"tokens (its first dim); pass one count per sample summing to x.shape[0]"
        )
    return tuple(int(v) for v in values)


def _short(values: list[int]) -> str:
    return str(values) if len(values) <= 16 else f"[{len(values)} counts: {values[:8]}...]"
