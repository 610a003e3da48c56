"""Context-parallel attention: local queries over the keys of the whole CP group, without
anything quadratic in memory.

Each CP rank holds ``s_local = S / cp`` tokens of every sequence. Attention runs as one
fused kernel call per (query run, key run) pair that can see each other (see
:mod:`~mp_bridge.layers.attention.block_kernels`: the CPU flash kernel, CUDA flash /
memory-efficient SDPA), each returning its log-sum-exp; partial outputs merge in fp32 by
LSE weights, and the backward hands each pair the merged output and LSE. Nothing of
``s_local x S`` elements (scores or mask) is built, in forward or backward.

Visibility comes from the *layout* (``ShardedBatch.layout`` of ``PartitionAdapter``,
parsed once per step on the host): plain input is two position runs per rank, packed
documents two per document, so every pair of runs is fully visible, invisible (no
kernel launch), or a square diagonal (``is_causal``); padding is its own segment and
never visible to a real token; a query only sees its own document. Without a layout,
user ``position_ids`` are parsed into runs on the host once per call (one device-to-host
copy); positions that form no runs fall back to float masks of one ``kv_block x
kv_block`` block pair at a time.

Collectives per call, CP group of ``n > 1`` (none when ``n == 1``); ``kv`` is
``2·b·s_local·hk·d`` elements:

- ``comm="all_gather"`` (default): forward **one** all-gather of ``[pos | K | V]``
  (positions only when given without a layout), backward **one** reduce-scatter of
  ``[dK, dV]``. Holds every rank's K/V (``n·kv``).
- ``comm="ring"``: forward ``n − 1`` send/recv steps of ``kv`` overlapped with the
  attention of the block in hand (at most two blocks held); backward ``n − 1`` steps of
  K/V and ``n − 1`` of ``dK/dV`` (2x the forward bytes). +1 all-gather of the positions
  when they are given without a layout.
- ``comm="a2a"`` (Ulysses): forward **three** all-to-alls (q, ``[K | V]`` to head shards;
  the output back), backward three; attention on ``hq / n`` heads over all ``S`` tokens.
  Needs ``hq`` and ``hk`` divisible by ``n``. +1 all-gather of positions as for ring.

Double backward (``create_graph=True``) raises a ``RuntimeError``: the fused kernels'
backward has no derivative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mp_bridge.checks import (
    agree,
    agreed,
    check_bool,
    check_group,
    check_int,
    check_positive_float,
    check_tensor,
)
from mp_bridge.comm import (
    PaddedLayout,
    all_gather_tensor,
    gather_kv,
    group_rank,
    group_size,
    heads_to_seq,
    normalize_cu_seqlens,
    seq_len_divisor,
    seq_to_heads,
)
from mp_bridge.layers.attention.local_attention import local_attention
from mp_bridge.layers.attention.merge import PositionMask
from mp_bridge.layers.attention.pieces import masked_pieces, run_pieces
from mp_bridge.layers.attention.ring_attention import ring_attention
from mp_bridge.layers.attention.runs import (
    Run,
    layout_runs,
    natural_order,
    runs_of_positions,
    shifted,
)

__all__ = ["COMM_MODES", "DEFAULT_KV_BLOCK", "context_parallel_attention"]

COMM_MODES = ("all_gather", "ring", "a2a")
DEFAULT_KV_BLOCK = 1024  # tokens per key block of the masked fallback (bench/attention.py)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [b, s_local, heads, d]")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} has dtype {t.dtype}; expected a floating dtype")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k, v dtypes differ (q {q.dtype}, k {k.dtype}, v {v.dtype}); cast them to one "
            "dtype first, e.g. k.to(q.dtype)"
        )
    b, s, hq, d = q.shape
    if hq == 0 or k.shape[2] == 0 or d == 0:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must have at least one head and a "
            f"head dim >= 1 ([b, s_local, heads, d]); check the TP split of the heads"
        )
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree on b, s_local and d"
        )
    if hq % k.shape[2]:
        raise ValueError(
            f"q heads={hq} must be a multiple of k/v heads={k.shape[2]} (grouped-query attention)"
        )


def check_softmax_scale(scale: object) -> float:
    """A finite float > 0 (nan or inf would make every score nan)."""
    return check_positive_float("softmax_scale", scale, fix="None = 1/sqrt(head dim)")


def _check_positions(position_ids: torch.Tensor, b: int, s: int) -> torch.Tensor:
    check_tensor("position_ids", position_ids, dtype="int", fix="the original token positions")
    pos = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; expected [{b}, {s}] or [{s}] "
            "(original positions of the local tokens)"
        )
    return pos.to(torch.int64)


def check_comm_heads(comm: object, hq: int, hk: int, n: int) -> str:
    """``comm`` if it is one of :data:`COMM_MODES` and, for ``"a2a"``, the local head
    counts ``hq`` / ``hk`` both divide by the CP size ``n``; else ``ValueError`` naming
    them (local: models call it at build time, before any collective)."""
    if comm not in COMM_MODES:
        raise ValueError(f"comm={comm!r} is not one of {COMM_MODES}; the default is 'all_gather'")
    if comm == "a2a" and (hq % n or hk % n):
        raise ValueError(
            f"comm='a2a' splits heads over the CP group of {n}: q heads {hq} and k/v heads "
            f"{hk} must each divide by {n}; use comm='all_gather' or 'ring', or a CP size "
            "that divides both head counts"
        )
    return comm


def _check_kv_block(kv_block: object) -> int:
    if kv_block is None:
        return DEFAULT_KV_BLOCK
    return check_int("kv_block", kv_block, low=1, fix="tokens per key block; None = default")


def _parse_layout(layout, cu_seqlens, n: int, b: int, s: int) -> PaddedLayout | None:
    """The one layout the call runs on: ``layout=``, a layout passed as ``cu_seqlens``, or
    ``cu_seqlens`` parsed here (packed); ``None`` when neither is given."""
    if layout is not None and cu_seqlens is not None:
        raise ValueError("pass layout= or cu_seqlens=, not both (ShardedBatch.layout has both)")
    given = layout if layout is not None else cu_seqlens
    if given is None:
        return None
    if isinstance(given, PaddedLayout):
        parsed = given
    elif layout is not None:
        raise TypeError(f"layout must be a PaddedLayout (ShardedBatch.layout), got {type(layout)}")
    else:
        bounds = normalize_cu_seqlens(given, seq_len_divisor(n), total=s * n)
        parsed = PaddedLayout.of_documents(bounds, n)
    if parsed.cp != n or parsed.padded_len != s * n:
        raise ValueError(
            f"the layout is cut for cp={parsed.cp} with {parsed.padded_len} tokens, but the "
            f"CP group has {n} ranks holding {s} tokens each; pass this step's "
            "ShardedBatch.layout"
        )
    if parsed.packed and b != 1:
        raise ValueError(
            f"packed input (cu_seqlens / a packed layout) needs b == 1, got b={b}; flatten "
            "the batch into one packed sequence"
        )
    return parsed


@dataclass(frozen=True)
class _AttentionSpec:
    """What the CP ranks of one attention call compare before the first collective."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: torch.dtype
    causal: bool
    positions: bool
    softmax_scale: float
    layout: tuple | None
    comm: str
    kv_block: int

    def fields(self) -> dict[str, object]:
        return {
            "q.shape": self.q_shape, "k.shape": self.k_shape, "dtype": self.dtype,
            "causal": self.causal, "position_ids given": self.positions,
            "softmax_scale": self.softmax_scale, "layout": self.layout, "comm": self.comm,
            "kv_block": self.kv_block,
        }  # fmt: skip


@dataclass(frozen=True)
class _Plan:
    """Every rank's runs (``runs[j]``, local offsets), or ``None``: masked blocks."""

    runs: tuple[tuple[Run, ...], ...] | None
    all_pos: torch.Tensor | None  # [pb, S] device positions (masked fallback)


def _all_runs(runs: tuple[tuple[Run, ...], ...], s: int) -> tuple[Run, ...]:
    return tuple(r for j, rs in enumerate(runs) for r in shifted(rs, j * s))


def _plan_of_positions(all_pos: torch.Tensor, n: int, s: int, kv_block: int) -> _Plan:
    """Runs from user positions (one host copy), unless they would need more kernel calls
    than the masked ``kv_block`` blocks (or the batch rows differ)."""
    host = all_pos.cpu().numpy()
    if host.shape[0] > 1 and not (host == host[:1]).all():
        return _Plan(None, all_pos)
    runs = tuple(runs_of_positions(host[0, j * s : (j + 1) * s]) for j in range(n))
    blocks = -(-s // kv_block)
    if max(len(r) for r in runs) * sum(len(r) for r in runs) > blocks * blocks * n:
        return _Plan(None, all_pos)
    return _Plan(runs, None)


def _gathered_attention(q, k, v, plan, *, r, n, s, causal, scale, group, pos, kv_block):
    if n == 1:  # nothing to gather: no stacked copy of K/V
        k_all, v_all, k_pos = k, v, pos
    else:
        kv, k_pos = gather_kv(torch.stack([k, v]), pos, group)  # [2, b, n·s, hk, d]
        k_all, v_all = kv[0], kv[1]
    if plan is None:  # positions without a layout: parsed from the gathered ones
        plan = _plan_of_positions(k_pos, n, s, kv_block)
    if plan.runs is None:
        masks = PositionMask(pos, plan.all_pos)
        pieces = masked_pieces(s, n * s, kv_block)
        return local_attention(q, k_all, v_all, pieces, scale=scale, masks=masks)
    index, key_runs = natural_order(_all_runs(plan.runs, s))
    if index is not None:  # keys in position order: fewer, longer block pairs
        idx = torch.as_tensor(index, device=q.device)
        k_all, v_all = k_all.index_select(1, idx), v_all.index_select(1, idx)
    pieces = run_pieces(plan.runs[r], key_runs, causal)
    return local_attention(q, k_all, v_all, pieces, scale=scale)


def _ring(q, k, v, plan, *, r, n, s, causal, scale, group, kv_block):
    if plan.runs is None:
        masks = PositionMask(plan.all_pos[:, r * s : (r + 1) * s], plan.all_pos)
        plans = [masked_pieces(s, s, kv_block, k_base=j * s) for j in range(n)]
        return ring_attention(q, k, v, plans, scale=scale, group=group, masks=masks)
    plans = [run_pieces(plan.runs[r], shifted(plan.runs[j], j * s), causal) for j in range(n)]
    return ring_attention(q, k, v, plans, scale=scale, group=group)


def _ulysses(q, k, v, plan, *, n, s, causal, scale, group, kv_block):
    d = q.shape[-1]
    qa = seq_to_heads(q, group)  # [b, n·s, hq/n, d]
    ka, va = seq_to_heads(torch.cat([k, v], dim=-1), group).split(d, dim=-1)
    if plan.runs is None:
        masks = PositionMask(plan.all_pos, plan.all_pos)
        pieces = masked_pieces(n * s, n * s, kv_block)
        out = local_attention(qa, ka, va, pieces, scale=scale, masks=masks)
        return heads_to_seq(out, group)
    index, runs = natural_order(_all_runs(plan.runs, s))
    if index is not None:
        idx = torch.as_tensor(index, device=q.device)
        qa, ka, va = (t.index_select(1, idx) for t in (qa, ka, va))
    out = local_attention(qa, ka, va, run_pieces(runs, runs, causal), scale=scale)
    if index is not None:
        out = out.index_select(1, torch.as_tensor(np.argsort(index), device=q.device))
    return heads_to_seq(out, group)


@agreed("mp_bridge.layers.context_parallel_attention")
def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp_group: dist.ProcessGroup | None = None,
    position_ids: torch.Tensor | None = None,
    causal: bool = True,
    cu_seqlens: PaddedLayout | Sequence[int] | torch.Tensor | None = None,
    softmax_scale: float | None = None,
    comm: str = "all_gather",
    kv_block: int | None = None,
    layout: PaddedLayout | None = None,
) -> torch.Tensor:
    """Attention of the local queries over the keys of the whole CP group.

    Args:
        q: ``[b, s_local, hq, d]``; ``k``, ``v``: ``[b, s_local, hk, d]`` with ``hq % hk == 0``
            (heads may already be TP-split; grouped-query heads share K/V, never repeated
            for the CPU kernel).
        cp_group: the CP group (``None`` = one process, no collective).
        position_ids: original positions of the local tokens, ``[b, s_local]`` or
            ``[s_local]``; key ``j`` is visible to query ``i`` iff ``pos[j] <= pos[i]``.
            Needed when ``causal=True`` and no layout is given; with a layout, visibility
            comes from the layout (positions are then only for RoPE, outside).
        causal: apply the causal mask.
        cu_seqlens: packed input (``b == 1``): the *global* cumulative lengths, tokens laid
            out as ``cp_shard_indices_packed(cu_seqlens, cp, rank)``, or a layout.
        softmax_scale: default ``1/sqrt(d)``.
        comm: how K/V travel: ``"all_gather"``, ``"ring"`` or ``"a2a"`` (module docstring).
        kv_block: tokens per key (and query) block of the masked fallback for positions
            that form no runs; bounds its float mask to ``kv_block²`` per block pair.
        layout: ``ShardedBatch.layout`` (plain or packed), parsed once per step: the fast
            path, no device-to-host copy. A packed layout may also come as ``cu_seqlens``.

    Returns ``[b, s_local, hq, d]`` in ``q.dtype``; the kernels run in the input dtype and
    partial results merge in fp32. A query that sees no key gets zeros. Every CP rank must
    pass the same shapes, ``comm`` and layout (checked when agreement is on).
    """
    check_group("cp_group", cp_group)
    _check_qkv(q, k, v)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    check_bool("causal", causal)
    n, rank = group_size(cp_group), group_rank(cp_group)
    comm = check_comm_heads(comm, hq, hk, n)
    kv_block = _check_kv_block(kv_block)
    parsed = _parse_layout(layout, cu_seqlens, n, b, s)
    if position_ids is None and causal and parsed is None:
        raise ValueError(
            "position_ids=None needs causal=False or a layout; pass the original positions "
            "or ShardedBatch.layout"
        )
    pos = None
    if position_ids is not None and parsed is None and causal:
        pos = _check_positions(position_ids, b, s).to(q.device)
    elif position_ids is not None:
        _check_positions(position_ids, b, s)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    scale = check_softmax_scale(softmax_scale)
    key = None if parsed is None else (parsed.padded_bounds, parsed.seq_len, parsed.padded_len)
    spec = _AttentionSpec(
        tuple(q.shape), tuple(k.shape), q.dtype, causal, pos is not None, scale, key, comm,
        kv_block,
    )  # fmt: skip
    agree("context_parallel_attention", cp_group, spec, device=q.device)

    if parsed is not None:
        plan = _Plan(tuple(layout_runs(parsed, j) for j in range(n)), None)
    elif pos is None:  # non-causal without a layout: every key visible
        plan = _Plan(tuple((Run(0, s, 0, 0),) for _ in range(n)), None)
    elif comm == "all_gather":
        plan = None  # positions travel with K/V; parsed after the gather
    else:
        plan = _plan_of_positions(all_gather_tensor(pos, cp_group, 1), n, s, kv_block)
    kw = dict(n=n, s=s, causal=causal, scale=scale, group=cp_group)
    if comm == "ring":
        return _ring(q, k, v, plan, r=rank, kv_block=kv_block, **kw)
    if comm == "a2a":
        return _ulysses(q, k, v, plan, kv_block=kv_block, **kw)
    return _gathered_attention(q, k, v, plan, r=rank, pos=pos, kv_block=kv_block, **kw)
