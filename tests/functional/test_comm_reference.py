"""The single-process references the CP oracle tests compare against, and checks of them.

Shared by ``test_partition.py``, ``test_cp_attention.py`` and ``test_comm_layouts.py``
(with ``tp_cp_groups`` and ``rand``, the groups and seeded tensors their cases use):

- ``ref_cut``: the load-balanced CP cut written independently of ``mp_bridge`` —
  ``tensor.chunk(2·cp)``, keep chunks ``i`` and ``2·cp−1−i`` (per sequence when packed),
  then ``chunk(tp)`` for sequence parallelism.
- ``reference_attention``: ``F.scaled_dot_product_attention`` on full tensors, per
  sequence when packed, with grouped-query K/V repeated to the query heads.

The tests in this file pin the references to literal layouts (DESIGN.md's example), so an
oracle that drifted together with the code under test would be caught here.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.grid import make_grid
from mp_bridge.testing import current_device


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
