"""Invariant mode (``invariant=True``): fixed Triton tiles over 256-row vocab blocks and
token tiles, folded in the canonical block tree; no cuBLAS GEMM feeds a bit.

Tokens go in chunks of whole row tiles and ``block_dweight.TILE_K`` tiles
(``call.chunk_size`` rounded up to a multiple of ``block_stats.row_tile``, 128 tokens in
bf16 / fp16 and 32 in fp32, and of ``TILE_K``, and capped so that ``C x max(K_max 256,
H)`` stays under 2**31 elements, the kernels' int32 offsets, with ``K_max`` the most real
blocks a rank holds: the same chunks on every rank; the chunk only bounds memory). Per
chunk of ``C`` tokens, ``K`` real local blocks:

- forward: ``block_stats`` (logits in registers) -> ``[S, K, C]``; once per group of
  chunks (``FOLD_TOKENS``), TP > 1 all-gathers every rank's raw block statistics (one
  all-gather, ``[tp, S, K_max, G]``: ranks padded to the most real blocks a rank holds)
  and ``fold_stats`` (one launch) folds all ``K`` real blocks in the canonical tree:
  the same kernel on the same leaves as TP = 1.
- backward: ``block_grad`` recomputes the logits (same kernel code, same bits) into ``g
  [C, K * 256]`` (input dtype); ``dhidden`` computes ``d h`` by hidden-column ownership:
  ``d h[:, cols] = g_full @ W_full[:, cols]``, one plain GEMM whose ``k`` loop runs over
  the whole real vocab in order (TP = 1: ``g`` times the shard; TP > 1: each rank owns a
  ``tensor_split`` slice of ``H``, gets ``W_full[:, cols_r]`` by one all-to-all per call,
  all-gathers ``g`` per chunk, and the ``[C, H / TP]`` column slices are all-gathered);
  ``block_dweight_`` adds ``g^T h`` tile by tile into an fp32 ``[R, H]`` accumulator (one
  ``d W`` rounding to the weight's dtype at the end; a single chunk writes ``d W`` in the
  weight's dtype directly, the same bits).

Why the bits depend on neither ``N`` nor TP: every kernel has fixed tile sizes (never
autotuned), a fixed ``k`` order and no split-K or atomics, so each element is computed by
one program from its own row / column data; statistics are folded in the one canonical
tree whatever the shard (``tree``: ``fold_stats``, on every rank's gathered raw block
statistics at TP > 1); each ``d h`` element is one sequential dot over the
global vocab rows, the same ``k`` steps at every TP size; ``d W`` sums token tiles in
token order. Shards must be whole blocks (``BlockLayout.of_shard``; at TP = 1 any width:
rows past the weight load as zeros, no padded copy). 3 Triton GEMM-like passes per chunk
(1 forward, 2 + the ``d W`` pass backward: 4 in all); the ``d h`` pass does ``TP`` times
this rank's share of the vocab (the whole vocab, ``1 / TP`` of the columns): the same
FLOPs. Memory beyond the outputs: forward, the ``[S, K, G]`` fp32 block statistics of a
fold group (every rank's blocks at TP > 1) and ``1 / 16`` of it of fold scratch; backward,
``[C, V_local]`` ``g`` of the chunk and the fp32 ``d W`` (none with a single chunk); TP > 1
adds the gathered ``g`` ``[TP, C, Kmax * 256]`` (``C x V`` in the input
dtype: 256 MiB at ``C = 1024``, ``V = 131072`` in bf16), this rank's weight columns
``[V, H / TP]`` for the whole call (plus a send buffer the size of the shard during the
one all-to-all) and ``(TP + 1) x [C, H / TP]`` fp32 per chunk for the column gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK, BlockLayout
from mp_bridge.layers.loss.engines.triton_ops.block_dweight import (
    TILE_K,
    accumulator,
    block_dweight_,
)
from mp_bridge.layers.loss.engines.triton_ops.block_grad import block_grad
from mp_bridge.layers.loss.engines.triton_ops.block_stats import block_stats, row_tile
from mp_bridge.layers.loss.engines.triton_ops.dhidden import dhidden
from mp_bridge.layers.loss.engines.triton_ops.fold_stats import fold_stats
from mp_bridge.layers.loss.engines.triton_ops.tiles import kernel_column_weights
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.reduce import (
    column_slices,
    exchange_columns,
    gather_blocks,
    gather_columns,
)

__all__ = ["DEFAULT_CHUNK_TOKENS", "FOLD_TOKENS", "TritonInvariantRunner", "default_chunk"]

#: Tokens per chunk without ``chunk_size``, times the TP size (``default_chunk``): ``g`` is
#: ``[1024 TP, V / TP]`` in the input dtype (256 MiB at V = 131072 in bf16, at every TP).
#: Why times TP: ``dhidden``'s grid is ``C / 128 x H / (256 TP)`` programs, 128 at ``C =
#: 1024``, ``H = 4096``, TP 1, but 16 at TP 8 with ``C = 1024``: the whole-vocab ``k`` loop
#: of each would leave 7 / 8 of an H200's 132 SMs idle. The price: the gathered ``g [C,
#: V]`` (TP > 1) is ``TP x`` that of TP 1 (2 GiB at TP 8, V = 131072, bf16); pass
#: ``chunk_size`` to bound it. No bit depends on the chunk.
DEFAULT_CHUNK_TOKENS = 1024
#: Tokens whose per-block statistics are folded at once (whole chunks): one ``fold_stats``
#: launch and (TP > 1) one all-gather per group, not per chunk; ``[S, K, 8192]`` fp32 is
#: 64 MiB at ``K = 512`` blocks (all ranks' at TP > 1), ``S = 4``. The fold is element-wise
#: in the tokens: no bit depends on the grouping.
FOLD_TOKENS = 8192


def default_chunk(tp_size: int) -> int:
    """Tokens per chunk without ``chunk_size`` at TP ``tp_size`` (see
    ``DEFAULT_CHUNK_TOKENS``)."""
    return DEFAULT_CHUNK_TOKENS * tp_size


@dataclass(frozen=True, eq=False)
class TritonInvariantRunner:
    """The invariant runner: ``stats`` (forward) and ``grads`` (backward) of one call."""

    weight: torch.Tensor  # [V_local, H] (TP = 1: any number of rows)
    tp_group: dist.ProcessGroup | None
    layout: BlockLayout
    spec: LossSpec
    chunk: int  # tokens per chunk, a multiple of row_tile(weight.dtype) and TILE_K

    @classmethod
    def build(cls, weight, tp_group, shard, spec, chunk_size: int | None) -> TritonInvariantRunner:
        layout = BlockLayout.of_shard(shard)  # raises before any collective
        chunk = chunk_size or default_chunk(layout.tp_size)
        tile = math.lcm(row_tile(weight.dtype), TILE_K)
        # the chunk's g [C, K * 256] and its h / d h rows [C, H] must stay under 2**31
        # elements (the kernels' int32 offsets, rows * stride; dhidden's gathered g uses
        # int64): a larger chunk only costs memory. K: the most real blocks a rank holds
        # (rank 0's), not this rank's: every rank must cut the same chunks (the per-chunk
        # and per-group collectives)
        most = min(layout.v_local // VOCAB_BLOCK, layout.num_real)
        widest = max(1, most * VOCAB_BLOCK, weight.shape[1])
        cap = max(tile, (2**31 - 1) // widest // tile * tile)
        return cls(weight, tp_group, layout, spec, min(-(-chunk // tile) * tile, cap))

    @property
    def _num_valid(self) -> int:
        lay = self.layout
        return max(0, min(lay.num_local * VOCAB_BLOCK, lay.vocab_size - lay.shard.start))

    @property
    def _colw(self) -> torch.Tensor | None:
        """fp32 class weights of the local ids below ``_num_valid`` (``None``: none)."""
        return kernel_column_weights(self.spec, self.layout.shard.start, self._num_valid)

    def columns(self, target: torch.Tensor) -> torch.Tensor:
        start, stop = self.layout.shard.start, self.layout.shard.stop
        inside = (target >= start) & (target < stop)
        return torch.where(inside, target - start, -1).contiguous()

    def _chunks(self, n: int):
        for s in range(0, n, self.chunk):
            yield slice(s, min(s + self.chunk, n))

    @property
    def _slots(self) -> int:
        """Blocks per rank in the raw statistics all-gather: the most real blocks a rank
        holds (rank 0's; later ranks hold as many or, past the vocab, fewer)."""
        return min(self.layout.v_local // VOCAB_BLOCK, self.layout.num_real)

    def stats(self, h: torch.Tensor, tcol: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        lay, spec, w, n = self.layout, self.spec, self.weight.detach(), h.shape[0]
        out = torch.empty((spec.num_stats, n), dtype=torch.float32, device=h.device)
        colw = self._colw
        k, slots = lay.num_local, (self._slots if lay.tp_size > 1 else lay.num_local)
        group = max(self.chunk, FOLD_TOKENS // self.chunk * self.chunk)
        for g0 in range(0, n, group):  # fold whole groups of chunks: one launch, one gather
            g1 = min(g0 + group, n)
            st = None
            for rows in self._chunks(g1 - g0):
                at = slice(g0 + rows.start, g0 + rows.stop)
                part = block_stats(
                    h[at], w, temp[at], tcol[at], n_blocks=k, num_valid=self._num_valid,
                    spec=spec, colw=colw,
                )  # fmt: skip
                if rows.stop - rows.start == g1 - g0 and k == slots:  # one chunk, no padding
                    st = part
                    break
                if st is None:  # slots past this rank's real blocks: never read
                    st = part.new_empty((spec.num_stats, slots, g1 - g0))
                st[:, :k, rows] = part
            if lay.tp_size > 1:  # every rank's blocks, rank-major: [tp, S, slots, G]
                st = gather_blocks(st, self.tp_group)
            out[:, g0:g1] = fold_stats(st, spec, lay.num_real)  # TP = 1's expression
        return out

    def grads(self, h, tcol, temp, lse, w, w_ent, ent, want_gw: bool, wab=None):
        lay, wt = self.layout, self.weight.detach()
        colw = None if wab is None else self._colw  # without wab: the unweighted kernels
        k, hd = lay.num_local, h.shape[1]
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        rows_w = min(k * VOCAB_BLOCK, wt.shape[0])
        fresh = want_gw and 0 < h.shape[0] <= self.chunk  # one chunk: d W written directly
        gw = acc = None
        if fresh:
            gw = torch.empty(wt.shape, dtype=wt.dtype, device=h.device)
            gw[rows_w:].zero_()  # weight rows past the real blocks: padding
        elif want_gw:
            acc = accumulator(rows_w, hd, h.device)
        d_hidden = self._column_owner(wt, hd) if h.shape[0] else None  # W columns: once
        for rows in self._chunks(h.shape[0]):
            g = block_grad(
                h[rows], wt, temp[rows], tcol[rows], lse[rows], w[rows],
                None if w_ent is None else w_ent[rows], None if ent is None else ent[rows],
                n_blocks=k, num_valid=self._num_valid, spec=self.spec, colw=colw,
                wab=None if wab is None else (wab[0][rows], wab[1][rows]),
            )  # fmt: skip
            d_hidden(g, gh[rows])
            if fresh:
                block_dweight_(gw[:rows_w], g, h[rows], fresh=True)
            elif acc is not None:
                block_dweight_(acc, g, h[rows])
            del g
        if acc is not None:
            gw = acc.to(self.weight.dtype).contiguous()  # one rounding of the fp32 sum
            if rows_w < self.weight.shape[0]:  # weight rows past the real blocks: padding
                gw = torch.cat([gw, gw.new_zeros((self.weight.shape[0] - rows_w, hd))])
        return gh, gw

    def _column_owner(self, wt: torch.Tensor, hd: int):
        """``fn(g, out)``: ``out [C, H] = g_full @ W_full`` of one chunk by column ownership
        (``dhidden``). TP = 1: the one plain GEMM over this shard. TP > 1: this rank's
        columns of ``W_full`` now (one all-to-all); per chunk, ``g`` all-gathered, this
        rank's columns computed, the column slices all-gathered into ``out``."""
        lay, group = self.layout, self.tp_group
        k_rows = lay.num_real * VOCAB_BLOCK  # the whole real vocab, every rank's blocks
        if lay.tp_size == 1:
            return lambda g, out: dhidden(g, wt, out, k_rows=k_rows, w_rows=wt.shape[0])
        # piece: the most real blocks a rank holds (rank 0's); ranks in vocab order, so
        # global row v sits in piece v // piece at v % piece (``dhidden``)
        piece = min(lay.v_local // VOCAB_BLOCK, lay.num_real) * VOCAB_BLOCK
        w_cols = exchange_columns(wt, piece, group)  # [TP, piece, Hc]
        width = column_slices(hd, lay.tp_size)[0].stop  # the widest slice: rank 0's

        def run(g, out):
            g_full = gather_blocks(g, group, piece)  # [TP, C, piece], the input dtype
            part = torch.empty((g.shape[0], width), dtype=torch.float32, device=g.device)
            dhidden(g_full, w_cols, part, k_rows=k_rows, w_rows=piece)
            gather_columns(part, out, group)

        return run
