"""Shared test oracles: independent single-process references and the groups tests use.

Import as ``from tests.oracles import ...`` (``tests`` is a package). None of these calls
the code under test to compute an expected value:

- ``ref_cut``: the load-balanced CP cut written independently of ``mp_bridge`` —
  ``tensor.chunk(2·cp)``, keep chunks ``i`` and ``2·cp−1−i`` (per sequence when packed),
  then ``chunk(tp)`` for sequence parallelism.
- ``reference_attention``: ``F.scaled_dot_product_attention`` on full tensors, per
  sequence when packed, with grouped-query K/V repeated to the query heads.
- ``run_bridge`` / ``bridge_mismatches``: a bridge run on a known global batch checked
  against the bridge's data contract (the global batch split over DP in contiguous
  blocks in both grids; for the loss ``sum(W * y)`` over the dest CP tokens, ``dL/dX = W``).
- ``tp_group`` / ``tp_member``: TP groups of consecutive ranks carved out of a test world;
  ``tp_cp_groups``: the TP and CP groups of a ``tp × cp`` grid.
- ``rand``, ``cu_of``, ``vocab_cut``, ``gather_rows``: seeded full tensors and the plain
  slicing / gathering the vocab-parallel tests compare with.

``tests/unit/test_oracles.py`` pins these references to literal layouts, so an oracle
that drifted together with the code under test would be caught there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import CollectiveCounter, current_device

ORDER = ("tp", "cp", "pp", "dp")
SBH = {"s": 0, "b": 1, "h": 2}  # dim_mapping of an [s, b, h] tensor
FLAT = {"b": 0, "h": 1}  # dim_mapping of a batch-major flattened (b*s, h) tensor


@functools.cache
def tp_cp_groups(cp: int, tp: int = 2):
    """``(cp_group, tp_group, cp_rank, tp_rank)`` of a ``tp × cp`` grid, dp filling the world.

    Collective on first use for a given ``(cp, tp)`` (every rank must call it, in the same
    order); cached afterwards, so a test module's cases share the groups.
    """
    grid = make_grid(tp=tp, cp=cp, dp=dist.get_world_size() // (tp * cp), create=("tp", "cp"))
    cp_g, tp_g = grid.get_pg("cp"), grid.get_pg("tp")
    return cp_g, tp_g, dist.get_rank(cp_g), dist.get_rank(tp_g)


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """The same N(0, scale²) tensor on every rank (CPU generator), on this rank's device."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(current_device())


def cu_of(lengths) -> list[int]:
    """Cumulative lengths ``[0, l0, l0+l1, ...]`` of a packed batch."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def ref_cut(full, dim, cp, r, lengths=None, tp=1, t=0):
    """CP rank ``r``'s tokens of ``full`` along ``dim`` (then TP rank ``t``'s SP piece).

    ``lengths``: packed sequence lengths along ``dim`` (``None``: one sequence). With
    ``cp = 1`` the whole sequence is kept, whatever its length.
    """
    seqs = [full] if lengths is None else list(full.split(list(lengths), dim))
    parts = []
    for seq in seqs:
        if cp == 1:
            parts.append(seq)
        elif seq.shape[dim]:
            chunks = seq.chunk(2 * cp, dim)
            parts += [chunks[r], chunks[2 * cp - 1 - r]]
    local = torch.cat(parts, dim)
    return local.chunk(tp, dim)[t] if tp > 1 else local


def _sdpa(q, k, v, causal):
    """``[b, s, h, d]`` wrapper of torch's attention; GQA K/V heads repeated to q's."""
    if k.shape[2] != q.shape[2]:
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


def reference_attention(q, k, v, lengths=None, causal=True):
    """Full-sequence attention in one process; ``lengths``: packed sequences along dim 1."""
    if lengths is None:
        return _sdpa(q, k, v, causal)
    split = [t.split(list(lengths), 1) for t in (q, k, v)]
    return torch.cat([_sdpa(a, b, c, causal) for a, b, c in zip(*split)], 1)


@dataclass
class BridgeRun:
    """One bridge forward + backward on this rank, with the data contract's expectations.

    ``grad`` / ``expected_grad``: the src input gradient and ``W`` on this rank's src rows,
    both ``[b, s, h]``; ``grad_without_cp_reduce``: what the gradient would be had the
    bridge skipped its CP all-reduce (``W`` zeroed outside this rank's dest CP tokens).
    """

    problems: list[str]
    grad: torch.Tensor
    expected_grad: torch.Tensor
    grad_without_cp_reduce: torch.Tensor
    forward: CollectiveCounter
    backward: CollectiveCounter


def dp_rows(layout: GridLayout, rank: int, batch: int) -> slice:
    """Data contract: the global batch is split over DP in contiguous blocks by DP index."""
    per = batch // layout.axis_size("dp")
    i = layout.coords(rank)["dp"]
    return slice(i * per, (i + 1) * per)


def run_bridge(
    bridge, src: GridLayout, dest: GridLayout, *, batch, seq, h=3, dtype=torch.float32,
    mapping=None, strided=False,
) -> BridgeRun:  # fmt: skip
    """Bridge a known global batch ``X [batch, seq, h]`` and backprop ``sum(W * y)`` over
    this rank's dest CP tokens (the independent ``ref_cut``); ``mapping``: ``None``
    (``[b, s, h]``), ``SBH`` or ``FLAT``; ``strided``: a non-contiguous input view."""
    rank = dist.get_rank()
    x_all = rand(batch, seq, h, seed=1).to(dtype)
    w_all = rand(batch, seq, h, seed=2).to(dtype)
    # Into the layout ``mapping`` describes, and back to [b, s, h].
    if mapping == SBH:
        to_map = from_map = lambda t: t.transpose(0, 1)
    elif mapping == FLAT:
        to_map, from_map = (lambda t: t.flatten(0, 1)), (lambda t: t.reshape(-1, seq, h))
    else:
        to_map = from_map = lambda t: t
    x = to_map(x_all[dp_rows(src, rank, batch)]).clone()
    if strided:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert not x.is_contiguous()
    x.requires_grad_()
    problems = []
    with CollectiveCounter() as fwd:
        y = from_map(bridge.communicate(x))
    if y.dtype != dtype or not torch.equal(y, x_all[dp_rows(dest, rank, batch)]):
        problems.append(f"{src} -> {dest}: forward is not the dest shard")
    cp, c = dest.axis_size("cp"), dest.coords(rank).get("cp", 0)
    idx = ref_cut(torch.arange(seq), 0, cp, c).to(y.device)
    w_dest = w_all[dp_rows(dest, rank, batch)]
    with CollectiveCounter() as bwd:
        (y.index_select(1, idx) * w_dest.index_select(1, idx)).sum().backward()
    grad, expected = from_map(x.grad), w_all[dp_rows(src, rank, batch)]
    if not torch.equal(grad, expected):
        problems.append(f"{src} -> {dest}: src gradient is not W on this rank's rows")
    mask = torch.zeros(seq, dtype=dtype, device=y.device)
    mask[idx] = 1
    return BridgeRun(problems, grad, expected, expected * mask[None, :, None], fwd, bwd)


def bridge_mismatches(
    src, dest, *, batch, seq, dtype=torch.float32, mapping=None, offset=0, src_order=ORDER,
    dest_order=ORDER, layouts=False, strided=False,
) -> list[str]:  # fmt: skip
    """Build grids ``src`` / ``dest`` (axis sizes) and a bridge, and return
    ``run_bridge``'s mismatches on this rank (none for ranks outside the grids).

    ``layouts``: hand the communicator ``GridLayout``s instead of the grids.
    """
    src_grid = make_grid(**src, rank_offset=offset, axis_names=src_order, create=())
    dest_grid = make_grid(**dest, rank_offset=offset, axis_names=dest_order, create=())
    sl, dl = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    args = (sl, dl) if layouts else (src_grid, dest_grid)
    with ColocatedBridgeCommunicator(*args, dim_mapping=mapping) as bridge:
        if dist.get_rank() not in sl.ranks:
            return []
        run = run_bridge(
            bridge, sl, dl, batch=batch, seq=seq, dtype=dtype, mapping=mapping, strided=strided
        )
    return run.problems


# ------------------------------------------------------------------ TP groups, vocab
_TP_GROUPS: dict[int, tuple[dist.ProcessGroup | None, bool]] = {}


def tp_group(tp: int) -> tuple[dist.ProcessGroup | None, bool]:
    """(this rank's TP group, whether it is in one): ranks ``[0, tp), [tp, 2 tp), ...``.

    ``None`` for TP = 1. With TP = 3 on 8 ranks, ranks 6 and 7 sit out. Collective on
    first use for a given ``tp`` (every rank creates every group, in the same order).
    """
    if tp == 1:
        return None, True
    if tp not in _TP_GROUPS:
        rank, mine = dist.get_rank(), None
        for start in range(0, dist.get_world_size() - tp + 1, tp):
            ranks = list(range(start, start + tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        _TP_GROUPS[tp] = (mine, mine is not None)
    return _TP_GROUPS[tp]


def rank_in(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group`` (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def tp_member(tp: int) -> tuple[bool, dist.ProcessGroup | None, int]:
    """``(inside, group, rank in group or -1)`` for ``tp_group(tp)``."""
    group, inside = tp_group(tp)
    return inside, group, (rank_in(group) if inside else -1)


def vocab_cut(full: torch.Tensor, v_local: int, rank: int, dim: int) -> torch.Tensor:
    """Rows ``[rank·v_local, (rank+1)·v_local)`` of ``full`` along ``dim``, zero padded
    past its end (a rank past the true vocab holds only padding)."""
    vocab, start = full.shape[dim], rank * v_local
    n = max(min(vocab - start, v_local), 0)
    shape = list(full.shape)
    shape[dim] = v_local
    out = full.new_zeros(shape)
    if n > 0:
        out.narrow(dim, 0, n).copy_(full.narrow(dim, start, n))
    return out


def gather_rows(x: torch.Tensor, group, tp: int) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0 (``x`` itself at TP 1)."""
    if tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def dense_attention_fp64(q, k, v, visible, scale=None):
    """The float64 dense oracle of attention: ``q [b, s_q, hq, d]``, ``k, v [b, s_k, hk, d]``
    (GQA heads repeated), ``visible [pb, s_q, s_k]`` bool; rows that see nothing are 0.

    The whole ``[b, h, s_q, s_k]`` score matrix, in float64: the test-only reference that
    ``context_parallel_attention`` must match (it never builds this matrix itself).
    """
    q, k, v = (t.double() for t in (q, k, v))
    if k.shape[2] != q.shape[2]:
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


def packed_visibility(lengths, causal=True, device=None):
    """``[1, S, S]`` bool: same document and (causal) key position <= query position."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    vis = doc[:, None] == doc[None, :]
    if causal:
        vis &= torch.ones(len(doc), len(doc), dtype=torch.bool).tril()
    return vis.unsqueeze(0).to(device)
