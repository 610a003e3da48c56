"""Run a :class:`~mp_bridge.comm.bridge.plans.row_move.RowMove`: the bridge's one row move.

:func:`run_leg` is the one place the bridge's row moves call ``all_to_all_single``
(ragged FAN_IN's counted byte message in ``ragged.py`` aside): local rows copied, then,
when the leg exchanges, one ``all_to_all_single`` with exact splits (a rank receives
exactly the rows its ``recv`` names; nothing to or from itself). Two autograd Functions,
one per kind of adjoint:

===================  =====================================  ===============================
Function             backward                               used by
===================  =====================================  ===============================
``_AdjointMove``     ``_AdjointMove`` of ``move.inverse()``  the image balancer (the inverse
                     (so ``create_graph=True`` records the   move), ragged (gather <->
                     backward collective too)                narrow)
``_OneWayMove``      [CP all-reduce] then ``move.backward``  route, stage (PP delivery):
                     outside autograd; double backward is   their backward sends each
                     refused (``forbid_double_backward``)   gradient to every holder
===================  =====================================  ===============================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import forbid_double_backward
from mp_bridge.comm.bridge.plans.row_move import MoveLeg, RowMove
from mp_bridge.comm.collectives.primitives import all_reduce_sum, group_size

__all__ = ["adjoint_move", "one_way_move", "run_leg"]


def run_leg(x: torch.Tensor, leg: MoveLeg, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` ``[leg.src_rows, *rest]`` -> ``[leg.dst_rows, *rest]`` (no autograd).

    ``group``: the leg's members in group order (``None`` or size 1: local copies only)."""
    assert x.shape[0] == leg.src_rows, (tuple(x.shape), leg.src_rows)
    dev, rest = x.device, x.shape[1:]
    y = (x.new_empty if leg.covers() else x.new_zeros)((leg.dst_rows, *rest))
    if len(leg.keep_dst):
        y[leg.keep_dst.to(dev)] = x[leg.keep_src.to(dev)]
    if leg.exchange and group_size(group) > 1:
        recv = leg.recv_counts()
        got = x.new_empty((sum(recv), *rest))
        payload = torch.cat([x[s.to(dev)] for s in leg.send])
        dist.all_to_all_single(got, payload.contiguous(), recv, leg.send_counts(), group=group)
        if len(got):
            y[torch.cat(leg.recv).to(dev)] = got
    return y


class _AdjointMove(torch.autograd.Function):
    """Forward: ``move.forward``. Backward: this Function on ``move.inverse()``."""

    @staticmethod
    def forward(ctx, x, move: RowMove, group):
        ctx.move, ctx.group = move, group
        return run_leg(x, move.forward, group)

    @staticmethod
    def backward(ctx, grad):
        return _AdjointMove.apply(grad, ctx.move.inverse(), ctx.group), None, None


class _OneWayMove(torch.autograd.Function):
    """Forward: ``move.forward``. Backward: [CP all-reduce of the incoming gradient over
    ``cp_group``] then ``move.backward``; ``where``/``why`` name the refusal of double
    backward."""

    @staticmethod
    def forward(ctx, x, move: RowMove, group, cp_group, where: str, why: str):
        ctx.move, ctx.group, ctx.cp_group, ctx.where = move, group, cp_group, (where, why)
        return run_leg(x, move.forward, group)

    @staticmethod
    def backward(ctx, grad):
        forbid_double_backward(*ctx.where)
        if ctx.cp_group is not None:  # CP shards' partial gradients -> the full one
            grad = all_reduce_sum(grad.contiguous(), ctx.cp_group)
        return run_leg(grad, ctx.move.backward, ctx.group), None, None, None, None, None


def adjoint_move(x: torch.Tensor, move: RowMove, group) -> torch.Tensor:
    """``move`` with its inverse as the adjoint (double-differentiable)."""
    return _AdjointMove.apply(x, move, group)


def one_way_move(
    x: torch.Tensor, move: RowMove, group, *, cp_group=None, where: str, why: str
) -> torch.Tensor:
    """``move`` whose backward is ``move.backward`` after an optional CP all-reduce
    (``cp_group``); ``backward(create_graph=True)`` raises naming ``where`` and ``why``."""
    return _OneWayMove.apply(x, move, group, cp_group, where, why)
