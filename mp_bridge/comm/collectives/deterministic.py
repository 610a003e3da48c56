"""All-reduce whose result is bitwise identical on every rank and from run to run.

``dist.all_reduce`` may sum in an order that depends on the algorithm, the topology and
the rank (ring/tree chunking in NCCL), so fp results can differ in the last bits between
ranks and runs. Here every rank all-gathers all contributions and folds them itself,
strictly in group rank order, with the same elementwise ops: same inputs, same bits.

Cost: one all-gather; each rank receives ``(n - 1) * numel`` elements and holds
``n * numel`` (use it for small tensors: losses, norms, statistics), plus, by default,
one tiny all-gather of shape/dtype metadata so a mismatch raises on every rank instead of
hanging or returning garbage.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from mp_bridge.comm.collectives.primitives import all_gather_tensor, group_size

__all__ = ["deterministic_all_reduce"]

_OPS = ("sum", "mean", "max", "min")


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


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    # hash() of a tuple of ints is not salted (str hashes are), so it agrees across processes.
    dtype_code = zlib.crc32(str(tensor.dtype).encode())
    code = [tensor.dim(), tensor.numel(), hash(tuple(tensor.shape)), dtype_code]
    return torch.tensor([code], dtype=torch.int64, device=tensor.device)


def _check_same_everywhere(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    metas = all_gather_tensor(_meta(tensor), group, 0).tolist()
    mine = _meta(tensor).tolist()[0]
    odd = [r for r, m in enumerate(metas) if m != mine]
    if odd:
        raise ValueError(
            f"deterministic_all_reduce: tensor shape/dtype differ across the group: this rank "
            f"has shape {tuple(tensor.shape)} dtype {tensor.dtype}, group ranks {odd} differ "
            "(ndim, numel, ...) = "
            + ", ".join(f"{metas[r][:2]}" for r in odd)
            + "; pass the same shape and dtype on every rank"
        )


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
    Collectives: one all-gather, plus one metadata all-gather when ``check``. Every rank
    must call it with the same ``op`` and a tensor of the same shape and dtype.
    Not differentiable (no autograd Function): the result carries no graph.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    op = _op_name(op)
    floating = tensor.is_floating_point()
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"tensor must be real floating or integer, got dtype={tensor.dtype}")
    if not floating and op == "mean":
        raise TypeError(f"op='mean' needs a floating tensor, got dtype={tensor.dtype}")
    if accumulate_dtype is not None and (
        not isinstance(accumulate_dtype, torch.dtype) or not accumulate_dtype.is_floating_point
    ):
        raise TypeError(
            f"accumulate_dtype must be a floating torch.dtype or None, got {accumulate_dtype!r}"
        )
    if floating:
        acc = accumulate_dtype or tensor.dtype
        acc = torch.promote_types(acc, tensor.dtype)  # never accumulate below the input
    else:
        acc = torch.int64
    n = group_size(group)
    if n > 1 and check:
        _check_same_everywhere(tensor, group)
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
