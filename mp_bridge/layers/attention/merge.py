"""Attention over a list of pieces: partial outputs merged by LSE in fp32, and the adjoint.

:func:`pieces_forward` runs every :class:`~mp_bridge.layers.attention.pieces.BlockPair` with
:func:`block_forward` and folds it into an :class:`LseMerge` (``out = Σ_i w_i · out_i``,
``w_i = exp(lse_i − lse)``, ``lse = log Σ_i exp(lse_i)``; a piece whose rows see nothing
has ``lse_i = −inf`` and weight 0). :func:`pieces_backward` gives each piece the merged
output and LSE (its probabilities are then the global ones) and sums the ``dq, dk, dv``
contributions in fp32. Tensors are ``[b, heads, s, d]`` views.

``MASKED`` pieces build their float mask ``[pb, 1, rows, keys]`` from the positions
(:class:`PositionMask`), never larger than one query block x one key block.

Non-finite values: a query that *sees* a non-finite key or value gets a NaN output; an
invisible one never reaches it. Keys of other documents, padding and skipped blocks
never enter a kernel; when the K/V in hand hold a non-finite value (one scalar read per
block in hand), ``CAUSAL`` and ``MASKED`` pieces run on cleaned K/V and the rows that see
a bad key are set to NaN afterwards (a kernel would spread a masked NaN by ``0 · NaN``,
as SDPA itself does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mp_bridge.layers.attention.block_kernels import block_backward, block_forward
from mp_bridge.layers.attention.pieces import CAUSAL, FULL, MASKED, BlockPair

__all__ = ["LseMerge", "PositionMask", "pieces_backward", "pieces_forward"]


@dataclass(frozen=True)
class PositionMask:
    """Causal visibility from positions: query ``[pb, s_q]``, key ``[pb, s_k]`` (int64)."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor

    def visible(self, p: BlockPair) -> torch.Tensor:
        """``[pb, rows, keys]`` bool: key ``j`` visible to query ``i`` iff ``pos_j <= pos_i``
        (``k_pos`` in the pieces' key numbering: every rank's keys, rank-major)."""
        k = self.k_pos[:, p.k0 : p.k1]
        return k[:, None, :] <= self.q_pos[:, p.q0 : p.q1, None]

    def mask(self, vis: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Float ``[pb, 1, rows, keys]``: 0 where visible, ``-inf`` elsewhere."""
        m = torch.zeros(vis.shape, dtype=dtype, device=vis.device)
        return m.masked_fill_(~vis, float("-inf")).unsqueeze(1)


def _finite_rows(t: torch.Tensor) -> torch.Tensor:
    """``[b, h, s]`` bool: the token's vector is finite."""
    return torch.isfinite(t).all(-1)


class LseMerge:
    """The running fp32 output ``[b, h, s, d]`` and LSE ``[b, h, s]`` of one query set."""

    def __init__(self, b: int, h: int, s: int, d: int, device: torch.device, dtype=torch.float32):
        """``dtype``: the output buffer's, fp32 unless no row is ever merged (covered_once)."""
        self.shape, self.device, self.dtype = (b, h, s, d), device, dtype
        self.acc: torch.Tensor | None = None  # allocated by the first piece
        self.lse: torch.Tensor | None = None
        self.fresh = np.ones(s, dtype=bool)  # host: rows no piece has written yet
        self.poison: torch.Tensor | None = None  # [b, h, s] bool, dirty K/V only

    def add(self, q0: int, q1: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        b, h, s, d = self.shape
        if self.acc is None and (q0, q1) == (0, s):  # the first piece covers every row:
            self.acc, self.lse = out, lse  # kept as the kernel gave it (no copy)
            self.fresh[:] = False
            return
        if self.acc is None:
            self.acc = torch.zeros(b, h, s, d, dtype=self.dtype, device=self.device)
            self.lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=self.device)
        if self.fresh[q0:q1].all():  # first piece of these rows: a copy, no merge
            self.acc[:, :, q0:q1] = out
            self.lse[:, :, q0:q1] = lse
            self.fresh[q0:q1] = False
            return
        if self.acc.dtype != torch.float32:  # rows seen twice: merge in fp32 from here
            self.acc = self.acc.float()
        self.fresh[q0:q1] = False
        old = self.lse[:, :, q0:q1]
        new = torch.logaddexp(old, lse)
        w_old = torch.exp(old - new).nan_to_num_(0.0).unsqueeze(-1)  # nan: both -inf
        w_new = torch.exp(lse - new).nan_to_num_(0.0).unsqueeze(-1)
        acc = self.acc[:, :, q0:q1]
        acc.mul_(w_old).add_(out.float() * w_new)
        old.copy_(new)

    def mark(self, q0: int, q1: int, rows: torch.Tensor) -> None:
        if self.poison is None:
            b, h, s, _ = self.shape
            self.poison = torch.zeros(b, h, s, dtype=torch.bool, device=self.device)
        self.poison[:, :, q0:q1] |= rows

    def output(self) -> torch.Tensor:
        if self.poison is not None:
            self.acc.masked_fill_(self.poison.unsqueeze(-1), float("nan"))
        return self.acc


def _dirty(kh: torch.Tensor, vh: torch.Tensor) -> bool:
    """Whether the K/V in hand may hold a non-finite value (one scalar read per block in
    hand). fp32 / bf16: their sums in their own dtype (one reduction each, accumulated in
    fp32 by the kernels, no copy) are not finite; a NaN or inf always makes a sum
    non-finite, and finite values whose sum overflows (past ~3e38) only send the block down
    the cleaning path, which is exact too. fp16 sums overflow at 65504: the exact
    element check."""
    if kh.dtype == torch.float16:
        return not bool(torch.isfinite(kh).all() & torch.isfinite(vh).all())
    return not bool(torch.isfinite(kh.sum() + vh.sum()))


def _inputs(qh, kh, vh, p: BlockPair, masks, k_shift: int, dirty: bool):
    """``(k, v, mask, seen_bad)`` of one piece. A ``MASKED`` piece gets its float mask.
    When the K/V in hand are ``dirty``, a ``CAUSAL`` / ``MASKED`` piece gets K/V cleaned of
    non-finite values and ``seen_bad [b, hq, rows]``: the rows that *see* one (a kernel
    would otherwise spread an invisible NaN through ``0 · NaN``); else ``seen_bad=None``."""
    keys = slice(p.k0 - k_shift, p.k1 - k_shift)
    k, v = kh[:, :, keys], vh[:, :, keys]
    vis = masks.visible(p) if p.kind == MASKED else None
    mask = None if vis is None else masks.mask(vis, qh.dtype)
    if not dirty or p.kind == FULL:  # FULL: every key is visible to every row
        return k, v, mask, None
    bad = ~(_finite_rows(k) & _finite_rows(v))  # [b, hk, keys]
    if vis is None:  # CAUSAL, square: row i sees keys 0..i
        seen_bad = bad.int().cummax(-1).values.bool()
    else:
        seen_bad = (vis.unsqueeze(1) & bad.unsqueeze(2)).any(-1)
    group = qh.shape[1] // kh.shape[1]
    k, v = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (k, v))
    return k, v, mask, seen_bad.repeat_interleave(group, dim=1)


def pieces_forward(
    merge: LseMerge,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    pieces: list[BlockPair],
    *,
    scale: float,
    masks: PositionMask | None = None,
    k_shift: int = 0,
) -> None:
    """Fold every piece of ``qh`` over ``kh, vh`` (key rows ``k0 - k_shift``) into ``merge``."""
    dirty = _dirty(kh, vh)
    for p in pieces:
        k, v, mask, seen_bad = _inputs(qh, kh, vh, p, masks, k_shift, dirty)
        if seen_bad is not None:
            merge.mark(p.q0, p.q1, seen_bad)
        q = qh[:, :, p.q0 : p.q1]
        out, lse = block_forward(q, k, v, causal=p.kind == CAUSAL, scale=scale, mask=mask)
        merge.add(p.q0, p.q1, out, lse)


def pieces_backward(
    gh: torch.Tensor,
    qh: torch.Tensor,
    kh: torch.Tensor,
    vh: torch.Tensor,
    oh: torch.Tensor,
    lse: torch.Tensor,
    pieces: list[BlockPair],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    scale: float,
    masks: PositionMask | None = None,
    k_shift: int = 0,
    assign: tuple[bool, bool] = (False, False),
) -> None:
    """Add every piece's ``(dq, dk, dv)`` into ``grads`` (``[b, h, s, d]`` each; fp32 where
    pieces sum). ``assign`` (query rows, key rows): every such row is in at most one piece,
    so its gradient is copied in, not added (the caller zeroes only uncovered rows)."""
    dq, dk, dv = grads
    put_q = torch.Tensor.copy_ if assign[0] else torch.Tensor.add_
    put_kv = torch.Tensor.copy_ if assign[1] else torch.Tensor.add_
    dirty = _dirty(kh, vh)
    for p in pieces:
        rows = slice(p.q0, p.q1)
        keys = slice(p.k0 - k_shift, p.k1 - k_shift)
        k, v, mask, _ = _inputs(qh, kh, vh, p, masks, k_shift, dirty)
        pq, pk, pv = block_backward(
            gh[:, :, rows], qh[:, :, rows], k, v, oh[:, :, rows], lse[:, :, rows],
            causal=p.kind == CAUSAL, scale=scale, mask=mask,
        )  # fmt: skip
        put_q(dq[:, :, rows], pq)
        put_kv(dk[:, :, keys], pk)
        put_kv(dv[:, :, keys], pv)
