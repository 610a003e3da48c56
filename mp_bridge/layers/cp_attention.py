"""Context-parallel attention: local queries attend over K/V all-gathered across CP ranks.

Each CP rank holds ``s_local = S / cp`` tokens of every sequence (any layout for plain
input, the load-balanced one of ``PartitionAdapter`` for packed input). K and V are
all-gathered across the CP group, and the local queries attend over all ``S`` keys with a
causal mask taken from the tokens' *original* positions, so the result equals
full-sequence attention in one process whatever order the tokens are held in.

Collectives per call (CP group of size ``n > 1``; none when ``n == 1``):

- forward: **one** all-gather (``mp_bridge.comm.gather_kv``). K, V and the key position
  ids travel in one byte buffer (``[pos | K | V]`` per rank), so positions cost no extra
  round trip.
- backward: **one** reduce-scatter(SUM) of the stacked ``[dK, dV]`` (every rank's queries
  contribute to every key's gradient; the adjoint of the all-gather). Double backward
  (``create_graph=True``) is supported: the adjoints are autograd Functions.

Memory: the scores are materialised, ``[b, heads, s_local, S]`` in fp32 — this is a
reference implementation for tests and small models, not a fused kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import (
    agree,
    agreed,
    check_bool,
    check_group,
    check_positive_float,
    check_tensor,
)
from mp_bridge.comm import (
    PaddedLayout,
    gather_kv,
    group_rank,
    group_size,
    normalize_cu_seqlens,
    packed_sequence_mask,
    seq_len_divisor,
)

__all__ = ["context_parallel_attention"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


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


@dataclass(frozen=True)
class _AttentionSpec:
    """What the CP ranks of one attention call compare before the K/V all-gather."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: torch.dtype
    causal: bool
    positions: bool
    softmax_scale: float
    cu_seqlens: tuple[int, ...] | None

    def fields(self) -> dict[str, object]:
        return {
            "q.shape": self.q_shape, "k.shape": self.k_shape, "dtype": self.dtype,
            "causal": self.causal, "position_ids given": self.positions,
            "softmax_scale": self.softmax_scale, "cu_seqlens": self.cu_seqlens,
        }  # fmt: skip


def _parse_packed(cu_seqlens: object, cp: int, s_local: int) -> PaddedLayout | None:
    """``cu_seqlens`` as a packed layout (parsed once here unless it already is one);
    ``None`` for plain input (``None``, or a plain ``ShardedBatch.layout``)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, PaddedLayout):
        return cu_seqlens if cu_seqlens.packed else None
    bounds = normalize_cu_seqlens(cu_seqlens, seq_len_divisor(cp), total=s_local * cp)
    return PaddedLayout.of_documents(bounds, cp)


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
) -> torch.Tensor:
    """Attention of the local queries over the keys of the whole CP group.

    Args:
        q: ``[b, s_local, hq, d]``; ``k``, ``v``: ``[b, s_local, hk, d]`` with ``hq % hk == 0``
            (heads may already be TP-split; grouped-query heads share K/V).
        cp_group: the CP group (``None`` = one process, no collective).
        position_ids: original positions of the local tokens, ``[b, s_local]`` or
            ``[s_local]``; key ``j`` is visible to query ``i`` iff ``pos[j] <= pos[i]``.
            Required when ``causal=True`` (the default); may be omitted when ``causal=False``.
        causal: apply the causal mask.
        cu_seqlens: packed input (``b == 1``): the *global* cumulative lengths; tokens
            must be laid out as ``cp_shard_indices_packed(cu_seqlens, cp, rank)``
            (``PartitionAdapter.shard`` does this). Queries only see keys of their own
            sequence; positions may be packed indices or restart at 0 per sequence. When
            the adapter padded the documents, pass ``ShardedBatch.layout`` (parsed once per
            step: no layer parses it again, and the mask is built once per layout) or
            ``ShardedBatch.cu_seqlens``, with its ``position_ids``: padding sits after each
            document's tokens, so causal attention never shows it to a real query. A plain
            ``ShardedBatch.layout`` means no packing.
        softmax_scale: default ``1/sqrt(d)``.

    Returns ``[b, s_local, hq, d]`` in ``q.dtype``; scores, softmax and the weighted sum
    of V are computed in fp32 for fp16/bf16 inputs. Collectives: see the module docstring.
    Every CP rank must pass the same shapes (not checkable without a collective).
    """
    check_group("cp_group", cp_group)
    _check_qkv(q, k, v)
    b, s, hq, d = q.shape
    hk = k.shape[2]
    check_bool("causal", causal)
    if position_ids is None and causal:
        raise ValueError("position_ids=None needs causal=False; pass the original positions")
    pos = None if position_ids is None else _check_positions(position_ids, b, s).to(q.device)
    n, rank = group_size(cp_group), group_rank(cp_group)
    layout = _parse_packed(cu_seqlens, n, s)
    same_seq = None
    if layout is not None:
        if b != 1:
            raise ValueError(
                f"packed input (cu_seqlens given) needs b == 1, got q of shape "
                f"{tuple(q.shape)}; flatten the batch into one packed sequence"
            )
        same_seq = packed_sequence_mask(layout, n, rank, seq_len=s * n, device=q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    softmax_scale = check_softmax_scale(softmax_scale)
    spec = _AttentionSpec(
        tuple(q.shape), tuple(k.shape), q.dtype, causal, pos is not None, softmax_scale,
        None if layout is None else layout.padded_bounds,
    )  # fmt: skip
    agree("context_parallel_attention", cp_group, spec, device=q.device)

    # ---- the one collective (forward) / reduce-scatter (backward)
    kv = torch.stack([k, v])  # [2, b, s, hk, d]
    kv, k_pos = gather_kv(kv, pos, cp_group)
    k_all, v_all = kv[0], kv[1]  # [b, S, hk, d]

    compute = torch.float32 if q.dtype in _LOW_PRECISION else q.dtype
    if hq != hk:  # grouped-query attention: q head j reads kv head j // (hq / hk)
        k_all = k_all.repeat_interleave(hq // hk, dim=2)
        v_all = v_all.repeat_interleave(hq // hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute), k_all.to(compute)) * softmax_scale

    allowed = None
    if causal:
        allowed = (k_pos[:, None, :] <= pos[:, :, None]).unsqueeze(1)  # [pb, 1, s, S]
    if same_seq is not None:
        allowed = same_seq if allowed is None else allowed & same_seq
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v_all.to(compute))
    return out.to(q.dtype)
