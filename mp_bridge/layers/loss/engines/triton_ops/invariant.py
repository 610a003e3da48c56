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
  [C, K * 256]`` (input dtype); ``dhidden`` computes ``d h`` by token-row ownership:
  ``d h[rows] = g_full[rows] @ W_full``, one plain GEMM whose ``k`` loop runs over the
  whole real vocab in order (TP = 1: ``g`` times the shard; TP > 1: each rank owns a
  ``tensor_split`` slice of the chunk's rows, gets the whole weight by one all-gather per
  call, its rows of every rank's ``g`` by one all-to-all per chunk, and the ``[C / TP,
  H]`` row slices are all-gathered into ``d h``); ``block_dweight_`` adds ``g^T h`` tile
  by tile into an fp32 ``[R, H]`` accumulator (one ``d W`` rounding to the weight's dtype
  at the end; a single chunk writes ``d W`` in the weight's dtype directly, the same
  bits). The three ``d h`` collectives are ``async_op`` and waited for where their result
  is used (``reduce.InFlight``): the weight's all-gather runs beside the first
  ``block_grad``, each ``g`` all-to-all beside its chunk's ``block_dweight_``, each ``d h``
  row all-gather beside the next chunk (the last beside the accumulator's rounding). Per
  rank and call at TP 8, 8192 x 4096 x 131072 in bf16: 1.35 GB received, was 2.17 GB by
  hidden-column ownership (the whole ``g`` gathered: 1.88 GB).

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
adds the whole gathered weight ``[TP, Kmax * 256, H]`` in the input dtype for the whole
backward (``V x H``: 1 GiB at 131072 x 4096 in bf16), this rank's rows of the gathered
``g`` ``[TP, C / TP, Kmax * 256]`` (``C / TP x V``: 256 MiB at ``C = 8192``, TP 8) and
its fp32 ``[C / TP, H]`` ``d h`` rows per chunk (a buffer of ``TP x`` those where ``TP``
does not divide ``C``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.comm import group_rank
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
    exchange_token_rows,
    gather_blocks,
    gather_token_rows,
    gather_weight_pieces,
    split_slices,
)

__all__ = ["DEFAULT_CHUNK_TOKENS", "FOLD_TOKENS", "TritonInvariantRunner", "default_chunk"]

#: Tokens per chunk without ``chunk_size``, per rank of the TP group, with at least 8 ranks
#: counted (``default_chunk``: 8192 tokens up to TP 8). Why 8192 at TP 1: one chunk of
#: 8192 tokens writes ``d W`` directly, and each further chunk moves the fp32 ``[V, H]``
#: accumulator in and out (4 GiB of HBM and L2 traffic per chunk at 131072 x 4096: 4.9 ms
#: of a predicted 66 at 8192 tokens in chunks of 1024); the price is ``g [8192, V]`` in
#: the input dtype (2 GiB at V = 131072 in bf16). Why ``1024 TP`` above: ``dhidden``'s grid
#: is ``C / (128 TP) x H / 256`` programs (token-row ownership), 128 at ``C = 8192``, ``H =
#: 4096``, TP 8; fewer leave an H200's 132 SMs idle in its whole-vocab ``k`` loop. Pass
#: ``chunk_size`` to bound the memory. No bit depends on the chunk.
DEFAULT_CHUNK_TOKENS = 1024
#: The TP size ``default_chunk`` counts at least (8192 tokens per chunk below it).
MIN_CHUNK_RANKS = 8
#: Tokens whose per-block statistics are folded at once (whole chunks): one ``fold_stats``
#: launch and (TP > 1) one all-gather per group, not per chunk; ``[S, K, 8192]`` fp32 is
#: 64 MiB at ``K = 512`` blocks (all ranks' at TP > 1), ``S = 4``. The fold is element-wise
#: in the tokens: no bit depends on the grouping.
FOLD_TOKENS = 8192


def default_chunk(tp_size: int) -> int:
    """Tokens per chunk without ``chunk_size`` at TP ``tp_size`` (see
    ``DEFAULT_CHUNK_TOKENS``)."""
    return DEFAULT_CHUNK_TOKENS * max(tp_size, MIN_CHUNK_RANKS)


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
        # TP > 1: the whole weight's all-gather starts now, beside the first block_grad
        d_hidden = self._row_owner(wt, hd) if h.shape[0] else None
        pending = []  # d h rows all-gathers in flight (TP > 1)
        for rows in self._chunks(h.shape[0]):
            g = block_grad(
                h[rows], wt, temp[rows], tcol[rows], lse[rows], w[rows],
                None if w_ent is None else w_ent[rows], None if ent is None else ent[rows],
                n_blocks=k, num_valid=self._num_valid, spec=self.spec, colw=colw,
                wab=None if wab is None else (wab[0][rows], wab[1][rows]),
            )  # fmt: skip
            finish = d_hidden(g)  # TP > 1: g's token-row all-to-all starts now
            if fresh:  # beside the all-to-all
                block_dweight_(gw[:rows_w], g, h[rows], fresh=True)
            elif acc is not None:
                block_dweight_(acc, g, h[rows])
            pending.append(finish(gh[rows]))  # waits; d h rows; their all-gather starts
            del g, finish
        if acc is not None:  # beside the last d h rows all-gather
            gw = acc.to(self.weight.dtype).contiguous()  # one rounding of the fp32 sum
            if rows_w < self.weight.shape[0]:  # weight rows past the real blocks: padding
                gw = torch.cat([gw, gw.new_zeros((self.weight.shape[0] - rows_w, hd))])
        for p in pending:
            if p is not None:
                p.wait()
        return gh, gw

    def _row_owner(self, wt: torch.Tensor, hd: int):
        """``start(g) -> finish(out)``: ``out [C, H] = g_full @ W_full`` of one chunk by
        token-row ownership (``dhidden``). TP = 1: ``finish`` runs the one plain GEMM over
        this shard (returns ``None``). TP > 1: the whole weight's all-gather starts now
        (once per call); ``start`` starts the all-to-all of ``g``'s token rows; ``finish``
        waits for both, computes this rank's rows (``split_slices``) over the whole vocab
        and starts their all-gather into ``out`` (returns its ``InFlight``). Every
        collective is ``async_op``: what the caller queues in between runs beside it."""
        lay, group = self.layout, self.tp_group
        k_rows = lay.num_real * VOCAB_BLOCK  # the whole real vocab, every rank's blocks
        if lay.tp_size == 1:

            def alone(g):
                def finish(out):
                    dhidden(g, wt, out, k_rows=k_rows, w_rows=wt.shape[0])

                return finish

            return alone
        # piece: the most real blocks a rank holds (rank 0's); ranks in vocab order, so
        # global row v sits in piece v // piece at v % piece (``dhidden``)
        piece = min(lay.v_local // VOCAB_BLOCK, lay.num_real) * VOCAB_BLOCK
        weights = gather_weight_pieces(wt, piece, group)  # [(cols, InFlight [TP, piece, Hg])]
        rank = group_rank(group)

        def start(g):
            sent = exchange_token_rows(g, piece, group)  # [TP, rows_r, piece]

            def finish(out):
                mine = split_slices(out.shape[0], lay.tp_size)[rank]
                g_rows = sent.wait()
                rows = mine.stop - mine.start
                part = torch.empty((rows, hd), dtype=torch.float32, device=g.device)
                for cols, full in weights:
                    dhidden(g_rows, full.wait(), part[:, cols], k_rows=k_rows, w_rows=piece)
                return gather_token_rows(part, out, group)

            return finish

        return start
