"""All-reduce whose result is bitwise identical on every rank and from run to run.

``dist.all_reduce`` may sum in an order that depends on the algorithm, the topology and
the rank (ring/tree chunking in NCCL), so fp results can differ in the last bits between
ranks and runs. Here every rank all-gathers all contributions and folds them itself,
strictly in group rank order, with the same elementwise ops: same inputs, same bits.

Cost: one all-gather; each rank receives ``(n - 1) * numel`` elements and holds
``n * numel`` (use it for small tensors: losses, norms, statistics), plus, by default
(``check=True``), the agreement check (one small all-gather): ranks that pass another
``op``, shape or dtype all raise the same error instead of hanging or silently folding
different reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import FrozenSpec, agree, agreed, check_bool, check_group, check_tensor
from mp_bridge.comm.collectives.primitives import all_gather_tensor, group_size

__all__ = ["deterministic_all_reduce"]

_OPS = ("sum", "mean", "max", "min")


@dataclass(frozen=True)
class ReduceSpec(FrozenSpec):
    """What every rank of the group must pass alike."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    accumulate_dtype: torch.dtype


def _op_name(op: object) -> str:
    """``op`` as one of ``_OPS``; ``torch.distributed.ReduceOp`` SUM/AVG/MAX/MIN map too."""
    if isinstance(op, str) and op in _OPS:
        return op
    reduce_ops = {"SUM": "sum", "AVG": "mean", "MAX": "max", "MIN": "min"}
    for name, ours in reduce_ops.items():
        if not isinstance(op, str) and op == getattr(dist.ReduceOp, name):
            return ours
    raise ValueError(
        f"op={op!r} is not supported; use one of {_OPS} (or dist.ReduceOp.SUM/AVG/MAX/MIN)"
    )


def _parse(tensor: object, op: object, accumulate_dtype: object) -> ReduceSpec:
    tensor = check_tensor("tensor", tensor)
    name = _op_name(op)
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"tensor must be real floating or integer, got dtype={tensor.dtype}")
    floating = tensor.is_floating_point()
    if not floating and name == "mean":
        raise TypeError(f"op='mean' needs a floating tensor, got dtype={tensor.dtype}")
    if accumulate_dtype is not None and (
        not isinstance(accumulate_dtype, torch.dtype) or not accumulate_dtype.is_floating_point
    ):
        raise TypeError(
            f"accumulate_dtype must be a floating torch.dtype or None, got {accumulate_dtype!r}"
        )
    if floating:  # never accumulate below the input
        acc = torch.promote_types(accumulate_dtype or tensor.dtype, tensor.dtype)
    else:
        acc = torch.int64
    return ReduceSpec(name, tuple(tensor.shape), tensor.dtype, acc)


@agreed("mp_bridge.comm.deterministic_all_reduce")
def deterministic_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    op: str | dist.ReduceOp = "sum",
    accumulate_dtype: torch.dtype | None = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in rank order; **out of place** (input untouched).

    Returns a new tensor with the shape and dtype of ``tensor``: ``op`` in ``"sum"``,
    ``"mean"``, ``"max"``, ``"min"`` (or the matching ``dist.ReduceOp``) of the group's
    tensors, folded as ``((x_0 + x_1) + x_2) + ...`` in group rank order. Floating inputs
    accumulate in ``accumulate_dtype`` (``None``: the input dtype; never narrower than the
    input), then cast back; integer inputs sum exactly in int64 (``"mean"`` needs a
    floating tensor). Any strides are fine (the input is packed first). ``group=None`` is
    one process, not the world (groups are always explicit here): it returns a copy.
    Collectives: one all-gather, plus the agreement check's small all-gather when
    ``check``: ranks with another ``op``, shape, dtype or ``accumulate_dtype`` all raise
    the same :class:`~mp_bridge.checks.AgreementError` (a ``ValueError``).
    Not differentiable (no autograd Function): the result carries no graph.
    """
    spec = _parse(tensor, op, accumulate_dtype)
    check_group("group", group, fix="group=None is one process")
    check_bool("check", check)
    op, acc = spec.op, spec.accumulate_dtype
    n = group_size(group)
    if n > 1 and check:
        agree("deterministic_all_reduce", group, spec, device=tensor.device, always=True)
    flat = tensor.detach().reshape(1, -1).contiguous()  # packs any strides
    parts = all_gather_tensor(flat, group, 0) if n > 1 else flat  # [n, numel], rank order
    out = parts[0].to(acc, copy=True)
    for i in range(1, n):
        x = parts[i].to(acc)
        if op in ("sum", "mean"):
            out = out.add_(x)
        elif op == "max":
            out = torch.maximum(out, x)
        else:
            out = torch.minimum(out, x)
    if op == "mean":
        out = out.div_(n)
    return out.to(tensor.dtype).reshape(tensor.shape)
