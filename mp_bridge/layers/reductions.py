"""Masked token reductions over the groups the tokens are spread over (e.g. DP and CP).

``group`` is ``None`` (one process), a ``ProcessGroup``, or a sequence of groups that are
summed over in turn; they must be *independent* axes (e.g. a DP group and a CP group,
or one DP×CP group), never two groups sharing an axis, or tokens are counted twice.

All results are fp32 scalars, accumulated in fp32. ``mask`` is bool or numeric with the
shape of ``values``; a numeric mask acts as per-token weights (``count`` is their sum).
Masked-out positions contribute exactly 0 even when ``values`` holds inf/nan there.

Collectives: one all-reduce(SUM) per group (``masked_mean`` batches sum and count into
the same all-reduce). Adjoint: the forward all-reduce has an *identity* backward
(``reduce_from_group``), so when every rank backpropagates the same global result, each
rank gets ``d(mean)/d(local values) = mask / global_count`` (and ``mask`` for the sum):
the gradient of the global quantity with respect to its own tokens, no more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_bridge.comm import check_agreement, group_size, reduce_from_group

__all__ = ["masked_count", "masked_mean", "masked_sum"]

Groups = dist.ProcessGroup | Sequence[dist.ProcessGroup | None] | None


def _groups(group: Groups) -> list[dist.ProcessGroup]:
    if group is None:
        return []
    if isinstance(group, dist.ProcessGroup):
        items = [group]
    elif isinstance(group, Sequence) and not isinstance(group, (str, bytes)):
        items = list(group)
    else:
        raise TypeError(
            f"group must be None, a ProcessGroup or a sequence of them, got {type(group).__name__}"
        )
    for g in items:
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"group entries must be ProcessGroups or None, got {type(g).__name__}")
    return [g for g in items if g is not None and group_size(g) > 1]


def _check_mask(mask: object, values: torch.Tensor | None) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"mask must be bool or real numeric, got {mask.dtype}")
    if values is None:
        return
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(
            f"values must be a floating tensor, got {getattr(values, 'dtype', values)!r}"
        )
    if tuple(mask.shape) != tuple(values.shape):
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal values shape {tuple(values.shape)}"
        )


def _check_weights(mask: torch.Tensor) -> None:
    """Counting weights are >= 0 (a negative weight would make the mean meaningless)."""
    if mask.dtype != torch.bool and bool((mask < 0).any()):  # one host sync
        raise ValueError(
            f"mask holds negative weight {float(mask[mask < 0].flatten()[0])}; a numeric mask "
            "is a per-token weight >= 0 (use a bool mask to select tokens)"
        )


def _agree(where: str, mask: torch.Tensor, groups: list[dist.ProcessGroup]) -> None:
    """Every rank of ``groups`` makes this same reduction (``MP_BRIDGE_CHECK``). A rank
    that passed no group makes no collective and cannot be seen: the others time out."""
    check_agreement(where, groups, {"number of groups": len(groups)}, device=mask.device)


def _local_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    v = values.float()
    if mask.dtype == torch.bool:
        return torch.where(mask, v, 0.0).sum()
    w = mask.float()
    return torch.where(w != 0, v * w, 0.0).sum()


def _local_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.float().sum() if mask.dtype != torch.bool else mask.sum().float()


def _all_sum(x: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    for g in groups:
        x = reduce_from_group(x, g)  # fwd all-reduce(SUM), bwd identity
    return x


def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, group: Groups = None) -> torch.Tensor:
    """Global ``sum(values * mask)`` over every rank of ``group`` (fp32 scalar)."""
    _check_mask(mask, values)
    groups = _groups(group)
    _agree("masked_sum", mask, groups)
    return _all_sum(_local_sum(values, mask), groups)


def masked_count(mask: torch.Tensor, *, group: Groups = None) -> torch.Tensor:
    """Global ``sum(mask)`` (the token count for a bool mask) as an fp32 scalar."""
    _check_mask(mask, None)
    _check_weights(mask)
    groups = _groups(group)
    _agree("masked_count", mask, groups)
    return _all_sum(_local_count(mask).detach(), groups)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, *, group: Groups = None) -> torch.Tensor:
    """Global ``sum(values * mask) / sum(mask)`` (fp32 scalar; 0 when no token is selected).

    One all-reduce per group carries ``[sum, count]`` together.
    """
    _check_mask(mask, values)
    _check_weights(mask)
    groups = _groups(group)
    _agree("masked_mean", mask, groups)
    both = _all_sum(torch.stack([_local_sum(values, mask), _local_count(mask)]), groups)
    total, count = both[0], both[1].detach()
    # Divide by 1 when empty (total is 0 then): avoids 0/0 = nan in value and gradient.
    return total / torch.where(count != 0, count, torch.ones_like(count))
