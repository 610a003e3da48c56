"""The torch engine's invariant runner (``invariant=True``): fixed-shape batched matmuls
over groups of vocab blocks, batched block math, tree folds (``TorchInvariantRunner``);
one statistics all-gather and one ``d h`` all-gather of subtree partials per chunk over
TP (``reduce``). Only the chunk's real blocks of logits, zero-padded to whole tiles, are
alive, plus O(log blocks) ``[TOKEN_TILE, H]`` fp32 partials."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.layers.loss.blocks import (
    BLOCK_GROUP,
    HIDDEN_ALIGN,
    TOKEN_TILE,
    BlockGroup,
    BlockLayout,
    block_groups,
    fold_blocks,
    target_slots,
)
from mp_bridge.layers.loss.class_weights import column_weights, target_weights
from mp_bridge.layers.loss.engines.torch_ops.driver import ChunkState
from mp_bridge.layers.loss.engines.torch_ops.group_steps import add_, add_weight_grad, settle
from mp_bridge.layers.loss.formulas import (
    LossSpec,
    block_stats_,
    exp_shift_,
    stats_values,
    transform_logits_,
)
from mp_bridge.layers.loss.grad import softmax_grad_blocks_
from mp_bridge.layers.loss.outputs import TokenOutputs
from mp_bridge.layers.loss.reduce import gather_fold
from mp_bridge.layers.loss.tree import StreamFold

__all__ = ["TorchInvariantRunner"]


@dataclass(frozen=True, eq=False)
class TorchInvariantRunner:
    """Fixed-shape batched matmuls over groups of vocab blocks, batched block math, tree folds.

    A chunk of ``C`` tokens is ``T = ceil(C / TOKEN_TILE)`` tiles (the last one zero
    padded); its logits are one fp32 ``[T, K, TOKEN_TILE, B]`` batch over the ``K`` real
    local blocks. Every matmul is one tile against one ``BlockGroup`` of ``G =
    BLOCK_GROUP`` blocks, with the hidden dim zero-padded to ``Hp``, a multiple of
    ``HIDDEN_ALIGN``; there are three calls, the same for every TP size, chunk size and
    batch (``tests/unit/test_invariant_shapes.py``)::

        logits    bmm  [G, TILE, Hp] x [G, Hp, B]     (the tile expanded over the group)
        d hidden  bmm  [G, TILE, B]  x [G, B, Hp]
        d weight  baddbmm_  [G, B, Hp] += [G, B, R] x [G, R, Hp]   (R = WEIGHT_GRAD_ROWS)
                  (R tokens at a time in token order; in a low input dtype: bmm, then add)

    Each batch entry is the product of one (tile, block), whose bits depend on the shapes
    and the entry alone (``bmm`` gives the bits of one ``mm`` per entry on this build,
    checked); a row's bits do not depend on its place in the tile (``HIDDEN_ALIGN``), so
    neither on the other tokens of the call. Chunks start on a multiple of
    ``TOKEN_TILE`` so tiles are the same for every chunk size.

    Cost: the FLOPs of the default runner plus the padding slots of a group (none when
    ``K`` is a multiple of ``G``; the last group of a larger shard is a window over blocks
    already done) and of ``Hp - H``; memory: a padded copy of the weight shard (and of its
    fp32 gradient during each chunk's backward) when ``H`` is not a multiple of
    ``HIDDEN_ALIGN`` or the shard holds fewer than ``G`` blocks. The hidden gradient adds
    ``K - 1`` adds of ``[TILE, Hp]`` per tile in tree order, ``P`` ``[chunk, Hp]`` subtree
    results and, at TP > 1, an all-gather in place of an all-reduce. Timings:
    ``bench/RESULTS.md``.
    """

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    layout: BlockLayout
    spec: LossSpec

    def __post_init__(self) -> None:
        # Frozen: the derived operands are set once here.
        k, b, h = self.layout.num_local, self.layout.block, self.weight.shape[1]
        hp = -(-h // HIDDEN_ALIGN) * HIDDEN_ALIGN
        wb = self.weight.detach()[: k * b].reshape(k, b, h)  # [K, B, H]: the real blocks
        if hp != h:
            wb = torch.nn.functional.pad(wb, (0, hp - h))
        if 0 < k < BLOCK_GROUP:
            wb = torch.cat([wb, wb.new_zeros((BLOCK_GROUP - k, b, hp))])
        object.__setattr__(self, "_hp", hp)
        object.__setattr__(self, "_wb", wb)  # [max(K, G), B, Hp]
        object.__setattr__(self, "_groups", block_groups(k))
        colw = column_weights(self.spec, self.layout.first * b, k * b)  # [K, B] or None
        object.__setattr__(self, "_colw", None if colw is None else colw.view(k, b))

    def _take(self, x: torch.Tensor, grp: BlockGroup) -> torch.Tensor:
        """The ``G`` slots of ``grp`` from ``x [K, ...]`` (zero padded when ``K < G``)."""
        if x.shape[0] >= BLOCK_GROUP:
            return x[grp.start : grp.start + BLOCK_GROUP]
        out = x.new_zeros((BLOCK_GROUP, *x.shape[1:]))
        out[: x.shape[0]] = x
        return out

    def _tiles(self, h: torch.Tensor) -> torch.Tensor:
        """``[T, TOKEN_TILE, Hp]`` copy of ``h`` (zero rows and columns: the fixed shape).

        Always a fresh buffer, so every matmul operand starts at an offset that depends
        on nothing but the tile index (not on where the chunk sits in the caller's tensor).
        """
        n, hd = h.shape
        hb = h.new_zeros((-(-n // TOKEN_TILE), TOKEN_TILE, self._hp))
        hb.view(-1, self._hp)[:n, :hd] = h
        return hb

    def _logits(self, hb: torch.Tensor, temp=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        tiles, k, b = hb.shape[0], self.layout.num_local, self.layout.block
        z = torch.empty((tiles, k, TOKEN_TILE, b), dtype=torch.float32, device=hb.device)
        out = hb.new_empty((BLOCK_GROUP, TOKEN_TILE, b))
        for i in range(tiles):
            hi = hb[i].expand(BLOCK_GROUP, TOKEN_TILE, self._hp)  # one tile, every block
            for grp in self._groups:
                wt = self._wb[grp.start : grp.start + BLOCK_GROUP].transpose(1, 2)
                if grp.hi - grp.lo == BLOCK_GROUP and out.dtype == torch.float32:
                    torch.bmm(hi, wt, out=z[i, grp.start : grp.start + BLOCK_GROUP])
                    continue  # a whole group: straight into the logits, same products
                torch.bmm(hi, wt, out=out)  # G x (TILE, Hp) @ (Hp, B)
                z[i, grp.start + grp.lo : grp.start + grp.hi].copy_(out[grp.lo : grp.hi])
        tt = None
        if temp is not None:  # [T, 1, TOKEN_TILE, 1]; padded rows divide by 1
            tt = temp.new_ones(tiles * TOKEN_TILE)
            tt[: temp.shape[0]] = temp
            tt = tt.view(tiles, 1, TOKEN_TILE, 1)
        deriv = transform_logits_(z, self.spec, tt)
        if deriv is not None and k and self.layout.tail < b:
            deriv[:, k - 1, :, self.layout.tail :] = 0.0  # padding columns
        return z, deriv

    def _padded(self, t: torch.Tensor, tiles: int) -> torch.Tensor:
        padded = t.new_full((tiles * TOKEN_TILE,), -1)
        padded[: t.shape[0]] = t
        return padded

    def _slots(self, t: torch.Tensor, tiles: int):
        return target_slots(self._padded(t, tiles), self.layout)

    def recompute(self, h: torch.Tensor, temp=None) -> ChunkState:
        hb = self._tiles(h)
        z, deriv = self._logits(hb, temp)
        return ChunkState(z, exp_shift_(z, self.layout), hb, deriv)

    def forward_chunk(
        self, h: torch.Tensor, t: torch.Tensor, temp=None
    ) -> tuple[ChunkState, TokenOutputs]:
        hb = self._tiles(h)
        z, deriv = self._logits(hb, temp)
        tiles, lay, spec = hb.shape[0], self.layout, self.spec
        slots = self._slots(t, tiles)
        stats, m = block_stats_(z, lay, slots, spec, self._colw)
        pieces = fold_blocks(stats, 2, lay, spec.merge)  # z <- exp(z - m) above
        shape = (spec.num_stats, tiles, TOKEN_TILE)
        root = gather_fold(pieces, lay, self.tp_group, spec.combine, shape, h.device)
        n = h.shape[0]
        omega = target_weights(spec, self._padded(t, tiles).view(tiles, TOKEN_TILE))
        out = stats_values(root, spec, omega=omega).map(lambda v: v.reshape(-1)[:n])
        return ChunkState(z, m, hb, deriv), out

    def grad_chunk(
        self, state, h, t, lse, w, gw: torch.Tensor | None, *, entropy=None, w_ent=None
    ) -> torch.Tensor:
        e, m, hb, deriv = state
        lay, b, hp = self.layout, self.layout.block, self._hp
        tiles, n, hd = hb.shape[0], h.shape[0], h.shape[1]
        rows = tiles * TOKEN_TILE

        def by_tile(v):  # [C] -> [tiles, TOKEN_TILE], padded rows 0
            return None if v is None else torch.cat([v, v.new_zeros(rows - n)]).view(tiles, -1)

        g = softmax_grad_blocks_(
            e,
            m,
            by_tile(lse),
            by_tile(w),
            self._slots(t, tiles),
            lay,
            self.spec,
            entropy=by_tile(entropy),
            w_ent=by_tile(w_ent),
            omega=by_tile(target_weights(self.spec, t)),
            colw=self._colw,
        )
        if deriv is not None:
            g.mul_(deriv)
        g = g if h.dtype == torch.float32 else g.to(h.dtype)
        k = lay.num_local
        gw_blocks = None if gw is None else gw[: k * b].view(k, b, hd)

        # d W accumulates in place in whole groups of G padded rows: in ``gw`` itself when
        # its rows allow it, else in a padded copy loaded from and stored back to ``gw``.
        acc = None
        if gw_blocks is not None:
            acc = gw_blocks
            if k < BLOCK_GROUP or hp != hd:
                acc = gw.new_zeros((max(k, BLOCK_GROUP), b, hp))
                acc[:k, :, :hd] = gw_blocks

        # Tile by tile, group by group: one reused [G, TILE, Hp] product buffer; the fold's
        # surviving nodes move into per-stack-position slots after each group (the adds and
        # their order are those of ``stream_fold``), and each tile's pieces into ``pieces``.
        part = torch.empty((BLOCK_GROUP, TOKEN_TILE, hp), dtype=torch.float32, device=h.device)
        slots: list[torch.Tensor] = []
        pieces = None
        for i in range(tiles):
            fold = StreamFold(add_)
            for grp in self._groups:
                gg = self._take(g[i], grp)
                wg = self._wb[grp.start : grp.start + BLOCK_GROUP]
                if gg.dtype == torch.float32:
                    torch.bmm(gg, wg, out=part)  # G x (TILE, B) @ (B, Hp)
                else:
                    part.copy_(torch.bmm(gg, wg))
                for j in range(grp.lo, grp.hi):
                    fold.push(lay.first + grp.start + j, part[j])
                settle(fold, slots)
            if pieces is None:
                pieces = [
                    (piece, part.new_empty((tiles, TOKEN_TILE, hp))) for piece, _ in fold.stack
                ]
            for (_, out), (_, v) in zip(pieces, fold.stack, strict=True):
                out[i].copy_(v)
        if acc is not None:
            # d W group by group (its [G, B, Hp] rows stay in cache), tiles in token order
            # inside each group: every element gets the adds of the tile-major order.
            for grp in self._groups:
                for i in range(tiles):
                    hi = hb[i].expand(BLOCK_GROUP, TOKEN_TILE, hp)
                    add_weight_grad(acc, self._take(g[i], grp), hi, grp)
            if acc is not gw_blocks:
                gw_blocks.copy_(acc[:k, :, :hd])
        root = gather_fold(pieces, lay, self.tp_group, add_, (tiles, TOKEN_TILE, hp), h.device)
        return root.reshape(-1, hp)[:n, :hd]
