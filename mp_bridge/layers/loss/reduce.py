"""The TP reductions of the losses: the only loss code that issues collectives.

Every collective of the loss paths is here, over ``tp_group`` (none when TP = 1):

========================  ==============================  ==================================
path                      statistics (forward)            ``d hidden`` (fused paths)
========================  ==============================  ==================================
materialized default      ``all_reduce_max_`` ``[N]``,    --
                          then ``all_reduce_sum_``
                          ``[S - 1, N]`` per call
fused default             ``gather_merge_stats``          ``all_reduce_sum_`` ``[C, H]``
                          ``[tp, S, C]`` per chunk        per chunk
invariant (both)          ``gather_fold``                 ``gather_fold``
                          ``[P, S, tiles, TOKEN_TILE]``   ``[P, tiles, TOKEN_TILE, H]``
                          per call (materialized) or      per chunk (torch engine)
                          per chunk (fused)
triton invariant          ``gather_blocks``               ``gather_weight_pieces``
                          ``[tp, S, K_max, G]`` per       ``[TP, Kmax 256, H]`` (input
                          ``FOLD_TOKENS`` group           dtype) once per call; per chunk
                                                          ``exchange_token_rows`` (all-to-
                                                          all, ``[TP, C / TP, Kmax 256]``)
                                                          and ``gather_token_rows``
                                                          ``[TP, ceil(C / TP), H]``; all
                                                          three ``async_op`` (``InFlight``)
========================  ==============================  ==================================

All fp32 (the materialized default path: fp64 for fp64 logits). ``S`` = 4 statistics per
row, one more for each per-token output beyond the value that has its own statistic
(``formulas.STATS``, ``LossSpec.num_stats``): they widen the one stats exchange and add no
collective; z-loss, soft-cap and temperature (a float or per token) add nothing. No loss
issues a collective in backward except the fused ``reduction="none"`` / log-prob paths,
which recompute chunks and reduce ``d hidden`` there. ``P`` is the most canonical subtrees a
rank holds (1 for power-of-two aligned shards); ``K_max`` the most real blocks a rank holds
(the triton engine gathers every block's raw statistics and folds all of them in one
kernel, ``fold_stats``: TP = 1's expression). The invariant paths never all-reduce: an
all-reduce's summation order depends on TP, so every rank folds the gathered subtree
partials in the canonical tree order (``tree``). The triton engine's invariant ``d h`` sums
no partials across ranks at all: each rank owns a slice of the chunk's token rows and
computes them over the whole vocab with the whole weight (``token-row ownership``,
``triton_ops.dhidden``), so only gathers and an all-to-all move data. Its three
collectives are issued ``async_op=True`` and waited for only where their result is used
(``InFlight``), so they run beside the kernels queued in between.

The two default statistics reductions stay distinct on purpose: the materialized path
shifts by the global max first (MAX then SUM, Megatron's scheme, two small collectives);
the fused path merges per-rank ``(m, s, tl, sz)`` partials by the online log-sum-exp after
one all-gather. The math is the same but the rounding differs, so unifying them would
change the bits of one default path (the recorded numerics hashes forbid that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.comm import all_gather_tensor, group_rank, group_size
from mp_bridge.layers.loss.blocks import BlockLayout
from mp_bridge.layers.loss.formulas import merge_stats
from mp_bridge.layers.loss.tree import Piece, fold_tree

__all__ = [
    "InFlight",
    "all_reduce_max_",
    "all_reduce_sum_",
    "exchange_token_rows",
    "gather_blocks",
    "gather_fold",
    "gather_merge_stats",
    "gather_token_rows",
    "gather_weight_pieces",
    "split_slices",
    "weight_groups",
]


def all_reduce_max_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise max of ``x`` over ``tp_group``, in place."""
    if group_size(tp_group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=tp_group)
    return x


def all_reduce_sum_(x: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Element-wise sum of ``x`` over ``tp_group`` (order depends on TP), in place."""
    if group_size(tp_group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp_group)
    return x


def gather_merge_stats(
    stats: torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    merge: Callable[[torch.Tensor, int], torch.Tensor] = merge_stats,
) -> torch.Tensor:
    """Global ``[S, C]`` statistics from every rank's ``[S, C]`` (one all-gather, rank
    order), merged by ``merge`` (``LossSpec.merge``)."""
    if group_size(tp_group) == 1:
        return stats
    gathered = all_gather_tensor(stats.unsqueeze(0), tp_group, 0)  # (tp, S, C)
    return merge(gathered.transpose(0, 1), 1)


def gather_blocks(
    x: torch.Tensor, tp_group: dist.ProcessGroup | None, width: int | None = None
) -> torch.Tensor:
    """``[tp, *x.shape]``: every rank's per-block tensor in rank order, one all-gather
    (``[1, ...]`` without a group). Each rank's real blocks come first along the last-but-
    one (statistics ``[S, K_max, G]``) or the last dim (``g [C, K * 256]``, zero-padded to
    ``width`` columns when given): the ranks' slots must have the same size."""
    if width is not None and x.shape[-1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return all_gather_tensor(x.unsqueeze(0), tp_group, 0)


def gather_fold(
    pieces: list[tuple[Piece, torch.Tensor]],
    layout: BlockLayout,
    tp_group: dist.ProcessGroup | None,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shape: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    """Root of the canonical tree from every rank's subtree partials (fp32, ``shape``).

    One all-gather of ``[P, *shape]`` over ``tp_group`` (none when TP = 1), ``P`` = the
    most pieces a rank holds; every rank then folds all pieces in the same tree order.
    """
    if layout.tp_size == 1:
        return fold_tree(dict(pieces), layout.num_real, combine)
    p_max, tp = layout.max_pieces, layout.tp_size
    packed = torch.zeros((p_max, *shape), dtype=torch.float32, device=device)
    for p, (_, value) in enumerate(pieces):
        packed[p] = value
    gathered = all_gather_tensor(packed, tp_group, 0).view(tp, p_max, *shape)
    owned = {piece: gathered[r, p] for r in range(tp) for p, piece in enumerate(layout.pieces(r))}
    return fold_tree(owned, layout.num_real, combine)


# --- the triton engine's invariant d h by token-row ownership (``triton_ops.dhidden``) -------


@dataclass(eq=False)
class InFlight:
    """An asynchronous collective (``async_op=True``: NCCL runs it on its own stream,
    ordered after the work already queued by an event; gloo on its own thread) and the
    tensor it fills. ``wait()`` makes the caller's stream wait for it (once), runs
    ``then`` on the filled tensor (a copy into place, on the caller's stream) and
    returns its result."""

    work: dist.Work | None
    out: torch.Tensor
    then: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep: tuple[torch.Tensor, ...] = ()  # the send buffers, alive until the wait
    _done: bool = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self.work is not None:
                self.work.wait()
            if self.then is not None:
                self.out = self.then(self.out)
            self._done, self.keep = True, ()
        return self.out


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> dist.Work | None:
    """Every rank's ``inp`` into ``out`` (``tp x inp.numel()`` elements, rank-major),
    started ``async_op``."""
    # torch >= 2.13 names it all_gather_single; older torch has all_gather_into_tensor
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    flat = out.view(-1, *inp.shape[1:])  # gloo wants [tp * rows, ...]
    return fn(flat, inp, group=group, async_op=True)


def split_slices(length: int, tp: int) -> list[slice]:
    """``torch.tensor_split`` of ``range(length)`` into ``tp`` slices (the first ``length %
    tp`` one longer; empty slices when ``tp > length``): the token rows of a chunk each
    rank owns in ``d h``."""
    q, r = divmod(length, tp)
    bounds = [i * q + min(i, r) for i in range(tp + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


#: Elements of one gathered weight group ``[TP, piece, Hg]``: ``dhidden`` indexes the
#: weight with int32 offsets, so the columns go in groups below ``2**31`` (one group up to
#: ``TP x piece x H < 2**31``, e.g. the whole 131072 x 4096 vocab; more for larger).
MAX_GROUP_ELEMENTS = 2**31 - 1


def weight_groups(hidden: int, tp: int, piece: int) -> list[slice]:
    """The hidden columns of each gathered weight group (whole 256-column tiles but the
    last; every group under ``MAX_GROUP_ELEMENTS``)."""
    width = max(1, MAX_GROUP_ELEMENTS // max(1, tp * piece))
    width = width // 256 * 256 or width
    return [slice(c, min(c + width, hidden)) for c in range(0, hidden, width)] or [slice(0, 0)]


def gather_weight_pieces(
    weight: torch.Tensor, piece: int, tp_group: dist.ProcessGroup | None
) -> list[tuple[slice, InFlight]]:
    """Started now: the whole weight as ``[TP, piece, Hg]`` per column group (``weight_groups``)
    for ``dhidden``: every rank's first ``piece`` shard rows (zeros past the rows ``weight``
    has), in rank (vocab) order. One all-gather per group, ``async_op``."""
    tp = group_size(tp_group)
    rows = min(weight.shape[0], piece)
    out = []
    for cols in weight_groups(weight.shape[1], tp, piece):
        width = cols.stop - cols.start
        if rows == piece and width == weight.shape[1] and weight.is_contiguous():
            send = weight[:piece]  # the shard as it is: no copy
        else:
            send = weight.new_zeros((piece, width))
            send[:rows] = weight[:rows, cols]
        full = weight.new_empty((tp, piece, width))
        out.append((cols, InFlight(_gather_into(full, send, tp_group), full, keep=(send,))))
    return out


def exchange_token_rows(
    g: torch.Tensor, piece: int, tp_group: dist.ProcessGroup | None
) -> InFlight:
    """Started now: ``[TP, rows_r, piece]``, every rank's ``g`` columns (its real blocks,
    zero-padded to ``piece``) at the token rows this rank ``r`` owns (``split_slices`` of
    the chunk). One all-to-all, ``async_op``: each rank receives ``1 / TP`` of an all-gather."""
    tp, rank = group_size(tp_group), group_rank(tp_group)
    if g.shape[1] < piece or not g.is_contiguous():  # rows in rank order: the send buffer
        g = torch.nn.functional.pad(g, (0, piece - g.shape[1])).contiguous()
    sizes = [(s.stop - s.start) * piece for s in split_slices(g.shape[0], tp)]
    out = g.new_empty((tp, sizes[rank] // piece, piece))
    work = dist.all_to_all_single(
        out.view(-1), g.view(-1), [sizes[rank]] * tp, sizes, group=tp_group, async_op=True
    )
    return InFlight(work, out, keep=(g,))


def gather_token_rows(
    part: torch.Tensor, out: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> InFlight:
    """Started now: ``out [C, H]`` from every rank's ``part [rows_r, H]`` (its
    ``split_slices`` rows of the chunk); one all-gather of ``[ceil(C / TP), H]``,
    ``async_op``, straight into ``out`` when the rows split evenly and ``out`` is
    contiguous, else through a buffer copied into place on ``wait``."""
    tp, (c, hd) = group_size(tp_group), out.shape
    slices = split_slices(c, tp)
    width = slices[0].stop - slices[0].start
    if c % tp == 0 and out.is_contiguous():
        part = part.contiguous()
        return InFlight(_gather_into(out, part, tp_group), out, keep=(part,))
    if part.shape[0] < width:
        part = torch.cat([part, part.new_zeros((width - part.shape[0], hd))])
    buf = part.new_empty((tp, width, hd))

    def place(gathered: torch.Tensor) -> torch.Tensor:
        for r, s in enumerate(slices):
            out[s] = gathered[r, : s.stop - s.start]
        return out

    part = part.contiguous()
    return InFlight(_gather_into(buf, part, tp_group), buf, place, keep=(part,))
