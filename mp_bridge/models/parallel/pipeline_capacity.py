"""One token capacity for every microbatch of a pipeline step (packed text).

A pipeline stage's send/receive buffers have one shape for the whole step, but packed
microbatches differ in length. Each microbatch is padded (before the CP/SP partition) to
a capacity ``C`` agreed by every rank with one all-reduce(MAX): a last **padding
document** of ``C − P`` tokens is appended, where ``P`` is the microbatch's length once
each document is padded to the CP cut (``2·cp``). ``C`` is a multiple of
``seq_len_divisor(cp, tp, sequence_parallel=sp)``, so the partition adds nothing more and
every microbatch's CP-local length is ``C / cp``. The padding document holds id 0, label
``PAD_LABEL`` and loss mask 0: causal attention keeps it to itself (it is its own
document) and the loss never sees it, so real tokens are unchanged.

Example, ``cp = 2``: documents ``[3, 5]`` have ``P = 4 + 8 = 12``; with ``C = 16`` a
padding document of 4 tokens is appended: ``cu_seqlens [0, 3, 8] -> [0, 3, 8, 12]``
(the partition then pads doc 0 to 4 tokens and doc 1 to 8, total 16).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import check_group, check_int
from mp_bridge.comm.sequence import PAD_LABEL, seq_len_divisor

__all__ = ["agree_capacity", "pad_packed_to", "packed_length"]


def packed_length(cu_seqlens: torch.Tensor, cp: int) -> int:
    """``P``: the packed total once each document is padded to a multiple of ``2·cp``
    (``cp = 1``: no padding). ``cu_seqlens`` ``[0, l0, l0+l1, ...]``."""
    cp = check_int("cp", cp, low=1)
    lengths = torch.as_tensor(cu_seqlens).to("cpu", torch.int64).diff()
    unit = 2 * cp if cp > 1 else 1
    return int(((lengths + unit - 1) // unit * unit).sum())


def agree_capacity(
    local: int,
    *,
    cp: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> int:
    """The largest ``local`` over ``group`` rounded up to the CP/SP divisor.

    ``local``: this rank's longest :func:`packed_length` over its microbatches. Every rank
    whose shapes must match (a whole LLM DP replica at least: its TP, CP and PP ranks)
    must be in ``group``. Collective: one all-reduce(MAX) of one integer.
    """
    local = check_int("local", local, low=0)
    check_group("group", group)
    value = torch.tensor([local], dtype=torch.int64, device=device)
    if group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    unit = seq_len_divisor(cp, tp, sequence_parallel=sequence_parallel)
    return max(-(-int(value) // unit) * unit, unit)


def pad_packed_to(
    capacity: int,
    *,
    cp: int,
    cu_seqlens: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Append one padding document so the microbatch fills ``capacity`` after the cut.

    Returns ``(cu_seqlens, input_ids, labels, loss_mask)`` (``None`` stays ``None``;
    1-D ``[T]`` tensors gain ``capacity − P`` tokens: id 0, label ``PAD_LABEL``, mask 0).
    Raises ``ValueError`` when the microbatch is longer than ``capacity``.
    """
    capacity = check_int("capacity", capacity, low=1)
    cu = torch.as_tensor(cu_seqlens).to(torch.int64)
    extra = capacity - packed_length(cu, cp)
    if extra < 0:
        raise ValueError(
            f"the microbatch needs {capacity - extra} tokens after the CP cut but "
            f"capacity={capacity}; agree on the capacity over every microbatch "
            f"(agree_capacity of the largest packed_length)"
        )
    if extra == 0:
        return cu, input_ids, labels, loss_mask
    cu = torch.cat([cu, cu[-1:] + extra])

    def grow(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, torch.full((extra,), fill, dtype=t.dtype, device=t.device)])

    return cu, grow(input_ids, 0), grow(labels, PAD_LABEL), grow(loss_mask, 0)
