"""Per-chunk kernels of the fused LM-head loss: default (one matmul per chunk) and invariant.

An engine turns one token chunk ``h [C, H]`` of the TP-replicated hidden states and the
local weight shard ``W [V_local, H]`` into per-token ``(value, lse)`` (``forward_chunk``),
and a chunk's logits plus per-token factors into the full ``d loss / d h`` rows and this
rank's ``d loss / d W`` (``grad_chunk``, accumulated in fp32). Only the chunk's logits
(``C x V_local`` fp32; the invariant engine's real blocks, zero-padded to whole tiles) are
ever alive, plus, in the invariant engine, O(log blocks) ``[C, H]`` fp32 partials.

Collectives per chunk over ``tp_group`` (none when TP = 1):

- ``DefaultEngine``: forward one all-gather of ``[4, C]`` fp32 stats; gradient one
  all-reduce(SUM) of ``[C, H]`` fp32 (``d h`` partials of the vocab shards).
- ``InvariantEngine``: forward one all-gather of ``[P, 4, tiles, TOKEN_TILE]``; gradient
  one all-gather of ``[P, tiles, TOKEN_TILE, H]`` subtree partials folded in the canonical
  tree order (an all-reduce's order depends on TP, so it cannot be used), where ``P`` is
  the most subtrees a rank holds (1 for power-of-two aligned shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.comm.primitives import all_gather_tensor

from ._loss_common import LossSpec
from .invariant_blocks import (
    TOKEN_TILE,
    BlockLayout,
    block_col,
    block_grad_,
    block_stats_,
    combine_stats,
    exp_shift_,
    fold_blocks,
    gather_fold,
    stats_values,
    target_slots,
)
from .vocab_blocks import stream_fold

__all__ = ["DefaultEngine", "InvariantEngine"]


def _add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.add_(y)


def _shard_grad_(
    z: torch.Tensor, valid: int, col: torch.Tensor, lse: torch.Tensor, w: torch.Tensor, spec
) -> torch.Tensor:
    """Default path: raw logits ``z [C, V_local]`` (fp32) -> ``d value / d z`` in place."""
    if valid < z.shape[1]:
        z[:, max(valid, 0) :] = float("-inf")
    return _softmax_to_grad_(z.sub_(lse.unsqueeze(1)).exp_(), valid, col, w, spec)


def _softmax_to_grad_(
    z: torch.Tensor, valid: int, col: torch.Tensor, w: torch.Tensor, spec: LossSpec
) -> torch.Tensor:
    """``z`` holds the softmax (0 on padding) -> ``w * (a * softmax + c) + w * b * onehot``."""
    a, b, c = spec.coefficients
    if a != 1.0:
        z.mul_(a)
    if c != 0.0 and valid > 0:
        z[:, :valid].add_(c)
    z.mul_(w.unsqueeze(1))
    # Rows whose target is elsewhere add an exact 0 at column 0.
    z.scatter_add_(1, col.clamp(min=0).unsqueeze(1), torch.where(col >= 0, w * b, 0.0).unsqueeze(1))
    return z


def _accumulate_weight_grad(gw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``gw += g^T @ h`` with ``gw`` fp32 whatever the dtype of ``g``/``h``."""
    if g.dtype == torch.float32:
        gw.addmm_(g.t(), h)
    else:
        gw.add_(torch.mm(g.t(), h).float())


@dataclass(frozen=True, eq=False)
class DefaultEngine:
    """Whole shard per chunk: ``z = h @ W^T`` is one ``[C, V_local]`` matmul."""

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    tp_size: int
    start: int  # first global id of this shard
    spec: LossSpec

    @property
    def valid(self) -> int:
        return max(0, min(self.weight.shape[0], self.spec.vocab_size - self.start))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.mm(h, self.weight.t())  # (C, H) @ (H, V_local)
        z = z if z.dtype == torch.float32 else z.float()
        if self.spec.temperature != 1.0:
            z.div_(self.spec.temperature)
        return z

    def forward_chunk(self, h: torch.Tensor, t: torch.Tensor):
        # The chunk's logits are turned into exp(z - m) in place (no second [C, V_local]
        # buffer); the gradient rescales them by exp(m - lse) per row.
        z = self.logits(h)
        valid = self.valid
        col = block_col(t, self.start, z.shape[1])
        if valid < z.shape[1]:
            z[:, valid:] = float("-inf")
        tl = torch.where(col >= 0, z.gather(1, col.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        with_sum = self.spec.coefficients[2] != 0.0
        sz = z[:, :valid].sum(dim=1) if with_sum and valid else torch.zeros_like(tl)
        if valid:
            m = z.amax(dim=1)
            s = z.sub_(m.unsqueeze(1)).exp_().sum(dim=1)
        else:  # a shard of padding only: the identity of the log-sum-exp merge
            m, s = torch.full_like(tl, float("-inf")), torch.zeros_like(tl)
            z.zero_()
        stats = torch.stack([m, s, tl, sz])
        if self.tp_size > 1:
            g = all_gather_tensor(stats.unsqueeze(0), self.tp_group, 0)  # (tp, 4, C)
            gm = g[:, 0].amax(dim=0)
            gs = (g[:, 1] * torch.exp(g[:, 0] - gm)).sum(dim=0)
            stats = torch.stack([gm, gs, g[:, 2].sum(dim=0), g[:, 3].sum(dim=0)])
        value, lse = stats_values(stats, self.spec)
        return (z, m), value, lse

    def recompute(self, h: torch.Tensor):
        return self.logits(h), None

    def grad_chunk(self, state, h, t, lse, w, gw: torch.Tensor | None) -> torch.Tensor:
        z, m = state
        col = block_col(t, self.start, z.shape[1])
        if m is None:  # raw logits (backward recompute)
            g = _shard_grad_(z, self.valid, col, lse, w, self.spec)
        else:  # exp(z - m) from forward: softmax = exp(z - m) * exp(m - lse)
            g = _softmax_to_grad_(
                z.mul_(torch.exp(m - lse).unsqueeze(1)), self.valid, col, w, self.spec
            )
        g = g.to(h.dtype)
        if gw is not None:
            _accumulate_weight_grad(gw, g, h)
        gh = torch.mm(g, self.weight)  # (C, V_local) @ (V_local, H): this shard's part
        gh = gh if gh.dtype == torch.float32 else gh.float()
        if self.tp_size > 1:
            dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=self.tp_group)
        return gh


@dataclass(frozen=True, eq=False)
class InvariantEngine:
    """Fixed ``[TOKEN_TILE, H] x [H, VOCAB_BLOCK]`` matmuls, batched block math, tree folds.

    A chunk of ``C`` tokens is ``T = ceil(C / TOKEN_TILE)`` tiles (the last one zero
    padded); its logits are one fp32 ``[T, K, TOKEN_TILE, VOCAB_BLOCK]`` batch over the
    ``K`` real local blocks, filled by one ``mm(..., out=)`` per (tile, block). The
    element-wise math and row reductions run once on the whole batch (per-row results do
    not depend on ``T`` or ``K``, see ``mp_bridge.layers.invariant``). Chunks must start on
    a multiple of ``TOKEN_TILE`` so tiles are the same for every chunk size.
    """

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    layout: BlockLayout
    spec: LossSpec

    def _tiles(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, TOKEN_TILE, H]`` copy of ``h`` (zero rows: the fixed shape, never a result).

        Always a fresh buffer, so every matmul operand starts at an offset that depends
        on nothing but the tile index (not on where the chunk sits in the caller's tensor).
        """
        n, hd = h.shape
        hb = h.new_zeros((-(-n // TOKEN_TILE), TOKEN_TILE, hd))
        hb.view(-1, hd)[:n] = h
        return hb

    def _w_block(self, j: int) -> torch.Tensor:
        b = self.layout.block
        return self.weight[j * b : (j + 1) * b]

    def _logits(self, hb: torch.Tensor) -> torch.Tensor:
        tiles, k, b = hb.shape[0], self.layout.num_local, self.layout.block
        z = torch.empty((tiles, k, TOKEN_TILE, b), dtype=torch.float32, device=hb.device)
        low = None if hb.dtype == torch.float32 else hb.new_empty((TOKEN_TILE, b))
        for j in range(k):  # block-major: the weight block stays in cache across tiles
            wt = self._w_block(j).t()
            for i in range(tiles):
                if low is None:
                    torch.mm(hb[i], wt, out=z[i, j])  # (TOKEN_TILE, H) @ (H, B)
                else:
                    z[i, j].copy_(torch.mm(hb[i], wt, out=low))
        if self.spec.temperature != 1.0:
            z.div_(self.spec.temperature)
        return z

    def _slots(self, t: torch.Tensor, tiles: int):
        padded = t.new_full((tiles * TOKEN_TILE,), -1)
        padded[: t.shape[0]] = t
        return target_slots(padded, self.layout)

    def recompute(self, h: torch.Tensor):
        hb = self._tiles(h)
        z = self._logits(hb)
        return hb, z, exp_shift_(z, self.layout)

    def forward_chunk(self, h: torch.Tensor, t: torch.Tensor):
        hb = self._tiles(h)
        z = self._logits(hb)
        tiles, lay = hb.shape[0], self.layout
        with_sum = self.spec.coefficients[2] != 0.0
        stats, m = block_stats_(z, lay, self._slots(t, tiles), with_sum)  # z <- exp(z - m)
        pieces = fold_blocks(stats, 2, lay, combine_stats)
        root = gather_fold(
            pieces, lay, self.tp_group, combine_stats, (4, tiles, TOKEN_TILE), h.device
        )
        value, lse = stats_values(root, self.spec)
        n = h.shape[0]
        return (hb, z, m), value.reshape(-1)[:n], lse.reshape(-1)[:n]

    def grad_chunk(self, state, h, t, lse, w, gw: torch.Tensor | None) -> torch.Tensor:
        hb, e, m = state
        lay, b = self.layout, self.layout.block
        tiles, n, hd = hb.shape[0], h.shape[0], h.shape[1]
        rows = tiles * TOKEN_TILE
        lse = torch.cat([lse, lse.new_zeros(rows - n)]).view(tiles, TOKEN_TILE)
        w = torch.cat([w, w.new_zeros(rows - n)]).view(tiles, TOKEN_TILE)  # padded rows: 0
        g = block_grad_(e, m, lse, w, self._slots(t, tiles), lay, self.spec)
        g = g if h.dtype == torch.float32 else g.to(h.dtype)
        pool: list[torch.Tensor] = []  # [TOKEN_TILE, H] partials freed by the fold, reused

        def leaves(i: int):
            # A generator: the fold keeps O(log K) [TOKEN_TILE, H] partials alive.
            for j in lay.real_local_blocks:
                gij = g[i, j]
                if gw is not None:  # tiles in token order: d W sums tokens tile by tile
                    _accumulate_weight_grad(gw[j * b : (j + 1) * b], gij, hb[i])
                out = pool.pop() if pool else hb.new_empty((TOKEN_TILE, hd), dtype=torch.float32)
                if h.dtype == torch.float32:
                    torch.mm(gij, self._w_block(j), out=out)  # (TOKEN_TILE, B) @ (B, H)
                else:
                    out.copy_(torch.mm(gij, self._w_block(j)))
                yield lay.first + j, out

        def add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            x.add_(y)
            pool.append(y)
            return x

        # Tile by tile (partials stay O(log K) x one tile); pieces stacked over tiles.
        per_tile = [stream_fold(leaves(i), add_) for i in range(tiles)]
        pieces = [
            (piece, torch.stack([tile[p][1] for tile in per_tile]))
            for p, (piece, _) in enumerate(per_tile[0])
        ]
        root = gather_fold(pieces, lay, self.tp_group, _add_, (tiles, TOKEN_TILE, hd), h.device)
        return root.reshape(-1, hd)[:n]
