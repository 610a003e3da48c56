"""Per-chunk kernels of the fused LM-head loss: default (one matmul per chunk) and invariant.

An engine turns one token chunk ``h [C, H]`` of the TP-replicated hidden states and the
local weight shard ``W [V_local, H]`` into per-token ``(value, lse)`` (``forward_chunk``),
and a chunk's logits plus per-token factors into the full ``d loss / d h`` rows and this
rank's ``d loss / d W`` (``grad_chunk``, accumulated in fp32). Only the chunk's logits
(``C x V_local`` fp32) are ever alive.

Collectives per chunk over ``tp_group`` (none when TP = 1):

- ``DefaultEngine``: forward one all-gather of ``[4, C]`` fp32 stats; gradient one
  all-reduce(SUM) of ``[C, H]`` fp32 (``d h`` partials of the vocab shards).
- ``InvariantEngine``: forward one all-gather of ``[P, tiles, 4, TOKEN_TILE]``; gradient
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
from .invariant import (
    TOKEN_TILE,
    BlockLayout,
    block_col,
    block_grad_,
    block_stats,
    combine_stats,
    gather_fold,
    softmax_to_grad_,
    stats_values,
)
from .vocab_blocks import stream_fold

__all__ = ["DefaultEngine", "InvariantEngine"]


def _add_(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.add_(y)


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
            g = block_grad_(z, self.valid, col, lse, w, self.spec)
        else:  # exp(z - m) from forward: softmax = exp(z - m) * exp(m - lse)
            g = softmax_to_grad_(
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
    """Fixed ``[TOKEN_TILE, H] x [H, VOCAB_BLOCK]`` matmuls, canonical-tree folds.

    Chunks must start on a multiple of ``TOKEN_TILE`` so tiles are the same for every
    chunk size.
    """

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    layout: BlockLayout
    spec: LossSpec

    def _tiles(self, h: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for s in range(0, h.shape[0], TOKEN_TILE):
            piece = h[s : s + TOKEN_TILE]
            if piece.shape[0] < TOKEN_TILE:  # zero rows: the fixed shape, never a result
                piece = torch.cat([piece, piece.new_zeros(TOKEN_TILE - piece.shape[0], h.shape[1])])
            out.append(piece.contiguous())
        return out

    def _w_block(self, j: int) -> torch.Tensor:
        b = self.layout.block
        return self.weight[j * b : (j + 1) * b]

    def recompute(self, h: torch.Tensor):
        tiles = self._tiles(h)
        blocks = []
        for ht in tiles:
            row = []
            for j in self.layout.real_local_blocks:
                z = torch.mm(ht, self._w_block(j).t())  # (T, H) @ (H, B)
                z = z if z.dtype == torch.float32 else z.float()
                if self.spec.temperature != 1.0:
                    z.div_(self.spec.temperature)
                row.append(z)
            blocks.append(row)
        return tiles, blocks

    def _cols(self, t: torch.Tensor, i: int) -> list[torch.Tensor]:
        tt = t[i * TOKEN_TILE : (i + 1) * TOKEN_TILE]
        if tt.shape[0] < TOKEN_TILE:
            tt = torch.cat([tt, tt.new_full((TOKEN_TILE - tt.shape[0],), -1)])
        lay = self.layout
        return [
            block_col(tt, (lay.first + j) * lay.block, lay.block) for j in lay.real_local_blocks
        ]

    def forward_chunk(self, h: torch.Tensor, t: torch.Tensor):
        state = self.recompute(h)
        lay, with_sum = self.layout, self.spec.coefficients[2] != 0.0
        local = []
        for i, row in enumerate(state[1]):
            cols = self._cols(t, i)
            leaves = (
                # block_stats masks padding columns of z in place; grad_chunk relies on it.
                (lay.first + j, block_stats(z, lay.valid(j), c, with_sum))
                for j, z, c in zip(lay.real_local_blocks, row, cols)
            )
            local.append(stream_fold(leaves, combine_stats))
        like = torch.zeros(4, TOKEN_TILE, device=h.device)
        roots = gather_fold(local, lay, self.tp_group, combine_stats, like)
        values, lses = zip(*(stats_values(r, self.spec) for r in roots))
        n = h.shape[0]
        return state, torch.cat(values)[:n], torch.cat(lses)[:n]

    def grad_chunk(self, state, h, t, lse, w, gw: torch.Tensor | None) -> torch.Tensor:
        tiles, blocks = state
        lay, b = self.layout, self.layout.block
        n, pad = h.shape[0], len(tiles) * TOKEN_TILE - h.shape[0]
        lse = torch.cat([lse, lse.new_zeros(pad)])
        w = torch.cat([w, w.new_zeros(pad)])  # padded rows: factor 0, no gradient

        def leaves(i: int, ht: torch.Tensor, row: list[torch.Tensor]):
            # A generator: the fold keeps O(log blocks) [T, H] partials alive, not one per block.
            rows = slice(i * TOKEN_TILE, (i + 1) * TOKEN_TILE)
            for j, z, c in zip(lay.real_local_blocks, row, self._cols(t, i)):
                g = block_grad_(z, lay.valid(j), c, lse[rows], w[rows], self.spec).to(h.dtype)
                if gw is not None:
                    _accumulate_weight_grad(gw[j * b : (j + 1) * b], g, ht)
                gh = torch.mm(g, self._w_block(j))  # (T, B) @ (B, H)
                yield lay.first + j, gh if gh.dtype == torch.float32 else gh.float()

        local = [
            stream_fold(leaves(i, ht, row), _add_) for i, (ht, row) in enumerate(zip(tiles, blocks))
        ]
        like = torch.zeros(TOKEN_TILE, h.shape[1], device=h.device)
        roots = gather_fold(local, lay, self.tp_group, _add_, like)
        return torch.cat(roots)[:n]
