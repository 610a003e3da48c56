"""Ulysses' all-to-all: sequence shards to head shards and back, as autograd Functions.

``seq_to_heads(x, group)``: ``x [b, s, h, d]`` (this rank's ``s`` tokens, all ``h`` heads)
-> ``[b, n·s, h/n, d]`` (every rank's tokens, rank-major, heads ``r·h/n .. (r+1)·h/n``).
``heads_to_seq`` is its inverse. Each is **one** ``all_to_all_single`` in forward and the
other's one in backward (each is the other's adjoint: a permutation of elements across
ranks). ``h`` must divide by ``n`` (the caller checks it at its door). Identity when
``n == 1``. Bytes received per call: ``(n − 1)/n`` of the tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.comm.collectives.primitives import group_size

__all__ = ["heads_to_seq", "seq_to_heads"]


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [n, b, s, h/n, d]
    recv = torch.empty_like(send)  # [n (source rank), b, s, h/n, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    b, ns, hn, d = x.shape
    send = x.reshape(b, n, ns // n, hn, d).permute(1, 0, 2, 3, 4).contiguous()  # [n, b, s, h/n, d]
    recv = torch.empty_like(send)  # [n (head block), b, s, h/n, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, ns // n, n * hn, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _HeadsToSeq.apply(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _SeqToHeads.apply(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[b, s, h, d] -> [b, n·s, h/n, d]`` over ``group`` (see the module docstring)."""
    return x if group_size(group) == 1 else _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``[b, n·s, h/n, d] -> [b, s, h, d]`` over ``group``: the inverse of seq_to_heads."""
    return x if group_size(group) == 1 else _HeadsToSeq.apply(x, group)
