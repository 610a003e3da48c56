"""Dense bridge execution: one autograd Function per direction (``communicate``).

=========  ==========================================  =====================================
direction  forward                                     backward (adjoint)
=========  ==========================================  =====================================
FAN_IN     all-gather along batch in the gather group  [CP all-reduce] then keep own slot
FAN_OUT    keep slot ``dest_dp mod k`` (local narrow)  [CP all-reduce] then all-gather batch
EQUAL      copy                                        [CP all-reduce]
=========  ==========================================  =====================================

Every output is a fresh tensor the caller owns (in-place ops on it never reach the
encoder's activation): FAN_IN returns the gather buffer itself (a layout copy only when the
batch dim is not dim 0), FAN_OUT copies its slot (``b_src / k`` rows), EQUAL copies the
input (the one copy an identity needs to stop aliasing).

Why the CP all-reduce: with dest CP > 1 the LLM takes its sequence chunks with
``index_select``, whose adjoint zero-pads, so each CP rank's incoming gradient holds only
its own chunks. Summing over the dest CP group rebuilds the full-sequence gradient before
the direction step (out of place: autograd owns the incoming buffer).

Double backward: FAN_IN and FAN_OUT raise on ``backward(create_graph=True)`` (their
backward collectives run outside autograd); EQUAL is ``copy_to_group``, which supports it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from mp_bridge.checks import check_int, forbid_double_backward
from mp_bridge.comm.bridge.plans.layouts import BridgeDirection
from mp_bridge.comm.collectives.primitives import all_gather_tensor, all_reduce_sum, copy_to_group

__all__ = ["DEFAULT_DIM_MAPPING", "bridge_dense", "check_dim_mapping"]

DEFAULT_DIM_MAPPING = {"b": 0, "s": 1, "h": 2}
_WHY = "its backward runs a collective outside autograd"


def check_dim_mapping(dim_mapping: Mapping[str, int] | None) -> dict[str, int]:
    """``dim_mapping`` as a dict with keys ``'b'``, ``'h'`` (optionally ``'s'``) mapped to
    the distinct dims ``0..n-1``; ``None`` gives :data:`DEFAULT_DIM_MAPPING`."""
    if dim_mapping is None:
        return dict(DEFAULT_DIM_MAPPING)
    if not isinstance(dim_mapping, Mapping):
        raise TypeError(
            f"dim_mapping must be a dict such as {{'b': 0, 's': 1, 'h': 2}}, "
            f"got {type(dim_mapping).__name__}"
        )
    mapping = dict(dim_mapping)
    unknown = sorted(set(mapping) - {"b", "s", "h"})
    missing = [k for k in ("b", "h") if k not in mapping]
    if unknown or missing:
        raise ValueError(
            f"dim_mapping={mapping} must have keys 'b' and 'h' (and optionally 's'); "
            f"unknown {unknown}, missing {missing}. Use {{'b': 0, 's': 1, 'h': 2}} or, for a "
            f"batch-major flattened (b*s, h) tensor, {{'b': 0, 'h': 1}}"
        )
    fix = (
        f"dim_mapping={mapping} must map its keys to the distinct tensor dims "
        f"0..{len(mapping) - 1} (one key per dim), e.g. {{'b': 0, 's': 1, 'h': 2}}"
    )
    try:
        values = [check_int(f"dim_mapping[{k!r}]", v, low=0) for k, v in mapping.items()]
    except TypeError:
        raise ValueError(fix) from None
    if sorted(values) != list(range(len(values))):
        raise ValueError(fix)
    return mapping


def _cp_all_reduce(grad: torch.Tensor, cp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the per-CP-rank partial gradients (out of place; identity for no/size-1 group)."""
    return all_reduce_sum(grad, cp_group)


def _slot(x: torch.Tensor, dim: int, slot: int, k: int) -> torch.Tensor:
    size = x.shape[dim] // k
    return x.narrow(dim, slot * size, size)


class _FanIn(torch.autograd.Function):
    """Forward: all-gather ``x`` along the batch dim in the gather group (members in
    concatenation order). Backward: CP all-reduce (if any), then keep this rank's slot."""

    @staticmethod
    def forward(ctx, x, gather_group, cp_group, dim, slot, k):
        ctx.cp_group, ctx.dim, ctx.slot, ctx.k = cp_group, dim, slot, k
        return all_gather_tensor(x, gather_group, dim)

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("ColocatedBridgeCommunicator.communicate (FAN_IN)", _WHY)
        grad = _cp_all_reduce(grad, ctx.cp_group)
        out = _slot(grad, ctx.dim, ctx.slot, ctx.k).contiguous()
        return out, None, None, None, None, None


class _FanOut(torch.autograd.Function):
    """Forward: keep slot ``dest_dp mod k`` of the batch (no communication). Backward: CP
    all-reduce (if any), then all-gather the slot gradients along batch in the gather group."""

    @staticmethod
    def forward(ctx, x, gather_group, cp_group, dim, slot, k):
        ctx.gather_group, ctx.cp_group, ctx.dim = gather_group, cp_group, dim
        # A copy, not a view: the output must not alias the caller's input.
        return _slot(x, dim, slot, k).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward("ColocatedBridgeCommunicator.communicate (FAN_OUT)", _WHY)
        grad = _cp_all_reduce(grad, ctx.cp_group)
        return all_gather_tensor(grad, ctx.gather_group, ctx.dim), None, None, None, None, None


def bridge_dense(
    x: torch.Tensor,
    *,
    direction: BridgeDirection,
    dim: int,
    slot: int,
    k: int,
    gather_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """One rank's dense bridge step (inputs already validated by the communicator)."""
    if direction is BridgeDirection.FAN_IN:
        return _FanIn.apply(x, gather_group, cp_group, dim, slot, k)
    if direction is BridgeDirection.FAN_OUT:
        return _FanOut.apply(x, gather_group, cp_group, dim, slot, k)
    # EQUAL: copy_to_group is identity forward and CP all-reduce backward (Megatron's f,
    # double-backward safe); the clone stops the output aliasing the input.
    return copy_to_group(x, cp_group).clone(memory_format=torch.contiguous_format)
