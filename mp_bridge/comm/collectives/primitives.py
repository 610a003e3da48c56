"""Differentiable collectives along a tensor dim, each with its written adjoint.

Every op takes its process group explicitly (``None`` = a single process, never a hidden
global) and is a no-op for a group of size 1. Shapes: ``x`` is this rank's piece; with
``n = group size`` and ``d = dim``, gathered outputs have ``n * x.shape[d]`` along ``d``,
in group rank order.

- ``copy_to_group``: identity; backward all-reduce(SUM) (Megatron's *f*).
- ``reduce_from_group``: all-reduce(SUM); backward identity (Megatron's *g*).
- ``gather_along``: all-gather along d; backward reduce-scatter(SUM) along d.
- ``gather_keep_grad``: all-gather along d; backward keeps this rank's slice of the grad.
- ``scatter_along``: keep this rank's slice along d; backward all-gather along d.
- ``reduce_scatter_along``: reduce-scatter(SUM) along d; backward all-gather (SP's g-bar).

Double backward: each Function's backward applies its adjoint *Function* (copy <->
reduce, gather_along <-> reduce_scatter_along, gather_keep_grad <-> scatter_along), so a
``backward(create_graph=True)`` records the backward collective in the graph and second
derivatives are correct. ``forbid_double_backward`` is the guard for Functions that cannot.

Collectives are called as ``dist.<name>`` at call time, so a ``CollectiveCounter`` sees them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import forbid_double_backward

__all__ = [
    "all_gather_tensor",
    "all_reduce_sum",
    "copy_to_group",
    "forbid_double_backward",
    "gather_along",
    "gather_keep_grad",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_along",
    "reduce_scatter_tensor",
    "scatter_along",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` means a single process (size 1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; ``None`` means rank 0 of a single process."""
    return 0 if group is None else dist.get_rank(group)


# ------------------------------------------------------- plain (non-autograd) helpers
def all_gather_tensor(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0):
    """All-gather ``x`` along ``dim`` in group rank order (one collective; no autograd)."""
    n = group_size(group)
    if n == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty(
        (n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device
    )
    _all_gather_single(out, moved, group)
    # dim 0: the buffer itself (movedim(0, 0) would return a view of it).
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def reduce_scatter_tensor(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0):
    """Sum ``x`` over the group and keep this rank's slice along ``dim`` (no autograd)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"reduce-scatter needs x.shape[{dim}]={x.shape[dim]} divisible by {n}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty(
        (moved.shape[0] // n,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device
    )
    _reduce_scatter_single(out, moved, group)
    return out.movedim(0, dim).contiguous()


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch >= 2.13 names it all_gather_single; older torch has all_gather_into_tensor.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over the group, out of place (no autograd; ``x`` is returned for size 1).

    Clones first: ``x`` may be a buffer autograd owns (an incoming gradient).
    """
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _own_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {n} equal parts")
    size = x.shape[dim] // n
    return x.narrow(dim, group_rank(group) * size, size).contiguous()


# ----------------------------------------------------------------- autograd ops
# Each backward applies the adjoint Function (not a plain collective), so double backward
# records the collective: copy <-> reduce, gather(sum) <-> reduce-scatter, gather(keep) <->
# scatter. Wrappers skip the Functions for a group of size 1, so they only run with n > 1.
class _CopyToGroup(torch.autograd.Function):
    """Forward identity; backward ``_ReduceFromGroup`` (all-reduce SUM)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _ReduceFromGroup.apply(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward all-reduce(SUM), out of place; backward identity (the adjoint of copy)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherAlong(torch.autograd.Function):
    """Forward all-gather along ``dim``; backward ``_ToShard`` with ``reduce=sum_grad``:
    reduce-scatter(SUM) (``sum_grad``) or this rank's slice (replicated gradient)."""

    @staticmethod
    def forward(ctx, x, group, dim, sum_grad):
        ctx.group, ctx.dim, ctx.sum_grad = group, dim, sum_grad
        return all_gather_tensor(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _ToShard.apply(grad, ctx.group, ctx.dim, ctx.sum_grad), None, None, None


class _ToShard(torch.autograd.Function):
    """Forward: this rank's slice along ``dim`` (of the group sum when ``reduce``).
    Backward: ``_GatherAlong`` with ``sum_grad=reduce`` (all-gather along ``dim``)."""

    @staticmethod
    def forward(ctx, x, group, dim, reduce):
        ctx.group, ctx.dim, ctx.reduce = group, dim, reduce
        return reduce_scatter_tensor(x, group, dim) if reduce else _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _GatherAlong.apply(grad, ctx.group, ctx.dim, ctx.reduce), None, None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim={dim} is out of range for a {x.dim()}-d tensor of shape {tuple(x.shape)}"
        )
    return dim % x.dim()


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward; all-reduce(SUM) of the gradient backward (Megatron's *f*)."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce(SUM) forward (out of place); identity backward (Megatron's *g*)."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_along(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """All-gather along ``dim``; backward reduce-scatters (sums the per-rank gradients).

    Use when every rank consumes the gathered tensor in a *different* partial loss.
    """
    if group_size(group) == 1:
        return x
    return _GatherAlong.apply(x, group, _dim(x, dim), True)


def gather_keep_grad(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """All-gather along ``dim``; backward keeps this rank's slice of the (replicated) grad.

    Use when the gradient of the gathered tensor is already identical on every rank.
    """
    if group_size(group) == 1:
        return x
    return _GatherAlong.apply(x, group, _dim(x, dim), False)


def scatter_along(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous slice along ``dim``; backward all-gathers the grad."""
    if group_size(group) == 1:
        return x
    return _ToShard.apply(x, group, _dim(x, dim), False)


def reduce_scatter_along(
    x: torch.Tensor, group: dist.ProcessGroup | None, dim: int
) -> torch.Tensor:
    """Reduce-scatter(SUM) along ``dim``; backward all-gathers the grad (SP's *g-bar*)."""
    if group_size(group) == 1:
        return x
    return _ToShard.apply(x, group, _dim(x, dim), True)
