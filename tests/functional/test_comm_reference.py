"""The single-process references the CP oracle tests compare against, and checks of them.

Shared by ``test_partition.py``, ``test_cp_attention.py`` and ``test_comm_layouts.py``
(with ``tp_cp_groups`` and ``rand``, the groups and seeded tensors their cases use):

- ``ref_cut``: the load-balanced CP cut written independently of ``mp_bridge`` —
  ``tensor.chunk(2·cp)``, keep chunks ``i`` and ``2·cp−1−i`` (per sequence when packed),
  then ``chunk(tp)`` for sequence parallelism.
- ``reference_attention``: ``F.scaled_dot_product_attention`` on full tensors, per
  sequence when packed, with grouped-query K/V repeated to the query heads.
- ``bridge_mismatches``: a bridge run on a known global batch checked against the data
  contract of DESIGN.md (used by ``test_comm_layouts.py`` and ``test_acceptance_comm.py``).

The tests in this file pin the references to literal layouts (DESIGN.md's example), so an
oracle that drifted together with the code under test would be caught here.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.comm import ColocatedBridgeCommunicator
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.testing import current_device

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


def bridge_mismatches(
    src,
    dest,
    *,
    batch,
    seq,
    dtype=torch.float32,
    mapping=None,
    offset=0,
    src_order=ORDER,
    dest_order=ORDER,
    layouts=False,
    strided=False,
):
    """Bridge a known global batch ``[batch, seq, 3]`` and backprop a weighted sum through
    the dest CP ``index_select``; return the mismatches with the data contract (global
    batch split over DP in contiguous blocks, both grids; ``dL/dX = W``) on this rank.

    ``layouts``: hand the communicator ``GridLayout``s instead of the grids; ``strided``:
    a non-contiguous input with the same values. The CP cut of the loss is ``ref_cut``.
    """
    rank, h = dist.get_rank(), 3
    src_grid = make_grid(**src, rank_offset=offset, dim_names=src_order, create=())
    dest_grid = make_grid(**dest, rank_offset=offset, dim_names=dest_order, create=("cp",))
    sl, dl = GridLayout.from_grid(src_grid), GridLayout.from_grid(dest_grid)
    x_all = rand(batch, seq, h, seed=1).to(dtype)
    w_all = rand(batch, seq, h, seed=2).to(dtype)

    def rows(layout):
        per = batch // layout.dim("dp")
        i = layout.coords(rank)["dp"]
        return slice(i * per, (i + 1) * per)

    # Into the layout ``mapping`` describes, and back to [b, s, h].
    if mapping == SBH:
        to_map = from_map = lambda t: t.transpose(0, 1)
    elif mapping == FLAT:
        to_map, from_map = (lambda t: t.flatten(0, 1)), (lambda t: t.view(-1, seq, h))
    else:
        to_map = from_map = lambda t: t
    bad = []
    args = (sl, dl) if layouts else (src_grid, dest_grid)
    with ColocatedBridgeCommunicator(*args, dim_mapping=mapping) as bridge:
        if rank not in sl.ranks:
            return bad
        x = to_map(x_all[rows(sl)]).clone()
        if strided:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        x.requires_grad_()
        y = from_map(bridge.communicate(x))
        if y.dtype != dtype or not torch.equal(y, x_all[rows(dl)]):
            bad.append(f"{src}->{dest}: forward is not the dest shard")
        idx = ref_cut(torch.arange(seq), 0, dl.dim("cp"), dl.coords(rank).get("cp", 0))
        idx = idx.to(y.device)
        (y.index_select(1, idx) * w_all[rows(dl)].index_select(1, idx)).sum().backward()
        if not torch.equal(from_map(x.grad), w_all[rows(sl)]):
            bad.append(f"{src}->{dest}: src gradient is not W on this rank's rows")
    return bad


# ------------------------------------------------------------ the references themselves
def test_ref_cut_literal_layouts():
    s8 = torch.arange(8)
    assert ref_cut(s8, 0, 2, 0).tolist() == [0, 1, 6, 7]  # DESIGN.md: chunks i, 2cp-1-i
    assert ref_cut(s8, 0, 2, 1).tolist() == [2, 3, 4, 5]
    assert ref_cut(s8, 0, 2, 0, tp=2, t=1).tolist() == [6, 7]  # then SP across TP
    assert ref_cut(torch.arange(12), 0, 2, 1, lengths=(4, 8)).tolist() == [1, 2, 6, 7, 8, 9]
    assert ref_cut(torch.arange(7), 0, 1, 0).tolist() == list(range(7))
    assert ref_cut(torch.arange(8), 0, 2, 1, lengths=(0, 8)).tolist() == [2, 3, 4, 5]
    assert cu_of((5, 7, 3)) == [0, 5, 12, 15]


def test_reference_attention_is_causal_and_per_sequence():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g) for _ in range(3))
    out = reference_attention(q, k, v, lengths=(2, 3))
    # The first query of each sequence sees only itself: its output is its own value.
    torch.testing.assert_close(out[:, [0, 2]], v[:, [0, 2]], rtol=0, atol=1e-6)
    # Changing the second sequence leaves the first one's outputs alone.
    v2 = v.clone()
    v2[:, 2:] += 1
    assert torch.equal(reference_attention(q, k, v2, lengths=(2, 3))[:, :2], out[:, :2])
