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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import FrozenSpec, agree, agreed, check_groups, check_tensor
from mp_bridge.comm import group_size, reduce_from_group

__all__ = ["masked_count", "masked_mean", "masked_sum"]

Groups = dist.ProcessGroup | Sequence[dist.ProcessGroup | None] | None


@dataclass(frozen=True)
class _ReduceSpec(FrozenSpec):
    """Every rank of the groups makes the same reduction over as many groups."""

    groups: int


def _groups(group: Groups) -> list[dist.ProcessGroup]:
    if isinstance(group, (str, bytes)) or not (
        group is None or isinstance(group, (dist.ProcessGroup, list, tuple))
    ):
        raise TypeError(
            f"group must be None, a ProcessGroup or a list of them, got {type(group).__name__}"
        )
    items = check_groups("group", group, fix="e.g. group=[dp_group, cp_group]")
    return [g for g in items if g is not None and group_size(g) > 1]


def _check_mask(mask: object, values: object) -> None:
    check_tensor("mask", mask)
    if mask.is_complex():
        raise TypeError(f"mask must be bool or real numeric, got {mask.dtype}")
    if values is None:
        return
    check_tensor("values", values, dtype="float")
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
    agree(where, groups, _ReduceSpec(len(groups)), device=mask.device)


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


@agreed("mp_bridge.layers.masked_sum")
def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, group: Groups = None) -> torch.Tensor:
    """Global ``sum(values * mask)`` over every rank of ``group`` (fp32 scalar)."""
    _check_mask(mask, values)
    groups = _groups(group)
    _agree("masked_sum", mask, groups)
    return _all_sum(_local_sum(values, mask), groups)


@agreed("mp_bridge.layers.masked_count")
def masked_count(mask: torch.Tensor, *, group: Groups = None) -> torch.Tensor:
    """Global ``sum(mask)`` (the token count for a bool mask) as an fp32 scalar."""
    _check_mask(mask, None)
    _check_weights(mask)
    groups = _groups(group)
    _agree("masked_count", mask, groups)
    return _all_sum(_local_count(mask).detach(), groups)


@agreed("mp_bridge.layers.masked_mean")
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
