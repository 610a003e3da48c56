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
triton invariant          ``gather_blocks``               ``exchange_columns`` (all-to-all,
                          ``[tp, S, K_max, G]`` per       ``W[:, cols_r]``) once per call;
                          ``FOLD_TOKENS`` group           per chunk ``gather_blocks``
                                                          ``[TP, C, Kmax 256]`` (input
                                                          dtype) and ``gather_columns``
                                                          ``[TP, C, ceil(H / TP)]``
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
no partials across ranks at all: each rank owns a slice of the hidden columns and computes
it over the whole vocab (``column ownership``, ``triton_ops.dhidden``), so only gathers
and one all-to-all move data.

The two default statistics reductions stay distinct on purpose: the materialized path
shifts by the global max first (MAX then SUM, Megatron's scheme, two small collectives);
the fused path merges per-rank ``(m, s, tl, sz)`` partials by the online log-sum-exp after
one all-gather. The math is the same but the rounding differs, so unifying them would
change the bits of one default path (the recorded numerics hashes forbid that).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mp_bridge.comm import all_gather_tensor, group_rank, group_size
from mp_bridge.layers.loss.blocks import BlockLayout
from mp_bridge.layers.loss.formulas import merge_stats
from mp_bridge.layers.loss.tree import Piece, fold_tree

__all__ = [
    "all_reduce_max_",
    "all_reduce_sum_",
    "column_slices",
    "exchange_columns",
    "gather_blocks",
    "gather_columns",
    "gather_fold",
    "gather_merge_stats",
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


# --- the triton engine's invariant d h by column ownership (``triton_ops.dhidden``) --------


def column_slices(hidden: int, tp: int) -> list[slice]:
    """Hidden columns each rank owns, ``torch.tensor_split`` of ``range(hidden)`` into
    ``tp`` (the first ``hidden % tp`` one column wider; an empty slice when ``tp >
    hidden``)."""
    q, r = divmod(hidden, tp)
    bounds = [i * q + min(i, r) for i in range(tp + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def exchange_columns(
    weight: torch.Tensor, piece: int, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[TP, piece, Hc]``: every rank's first ``piece`` shard rows (zeros past the rows
    ``weight`` has), this rank's hidden columns (``column_slices``); one all-to-all."""
    tp, rank = group_size(tp_group), group_rank(tp_group)
    cols = column_slices(weight.shape[1], tp)
    rows = min(weight.shape[0], piece)
    sizes = [piece * (c.stop - c.start) for c in cols]
    send = weight.new_zeros(sum(sizes))
    for c, part in zip(cols, send.split(sizes)):
        part.view(piece, c.stop - c.start)[:rows] = weight[:rows, c]
    mine = cols[rank].stop - cols[rank].start
    out = weight.new_empty((tp, piece, mine))
    dist.all_to_all_single(out.view(-1), send, [piece * mine] * tp, sizes, group=tp_group)
    return out


def gather_columns(part: torch.Tensor, out: torch.Tensor, tp_group: dist.ProcessGroup | None):
    """``out [C, H]`` from every rank's ``part [C, >= Hc]`` (its ``column_slices`` first);
    one all-gather of ``[C, ceil(H / TP)]``."""
    tp = group_size(tp_group)
    cols = column_slices(out.shape[1], tp)
    width = cols[0].stop - cols[0].start
    gathered = all_gather_tensor(part[:, :width].unsqueeze(0).contiguous(), tp_group, 0)
    for r, c in enumerate(cols):
        out[:, c] = gathered[r, :, : c.stop - c.start]
