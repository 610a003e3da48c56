"""Invariant mode (``invariant=True``): fixed Triton tiles over 256-row vocab blocks and
token tiles, folded in the canonical block tree; no cuBLAS GEMM feeds a bit.

Tokens go in chunks of whole row tiles (``call.chunk_size`` rounded up to a multiple of
``block_stats.row_tile``: 128 tokens in bf16 / fp16, 32 in fp32; the chunk only bounds
memory). Per chunk of ``C`` tokens, ``K`` real local blocks:

- forward: ``block_stats`` (logits in registers) -> ``[S, K, C]``; ``fold_blocks`` folds
  this rank's subtrees and ``gather_fold`` (one all-gather) the ranks' in tree order,
  once per group of chunks (``FOLD_TOKENS``).
- backward: ``block_grad`` recomputes the logits (same kernel code, same bits) into ``g
  [C, K * 256]`` (input dtype); ``block_dhidden`` folds ``g @ W`` per block in the tree
  inside the kernel, ``gather_fold`` (one all-gather) finishes it; ``block_dweight_``
  adds ``g^T h`` tile by tile into an fp32 ``[R, H]`` accumulator (one ``d W`` rounding
  to the weight's dtype at the end).

Why the bits depend on neither ``N`` nor TP: every kernel has fixed tile sizes (never
autotuned), a fixed ``k`` order and no split-K or atomics, so each element is computed by
one program from its own row / column data; statistics and ``d h`` are folded in the one
canonical tree whatever the shard (``tree``); ``d W`` sums token tiles in token order.
Shards must be whole blocks (``BlockLayout.of_shard``; at TP = 1 any width: rows past
the weight load as zeros, no padded copy). 3 Triton GEMM-like passes per chunk (1 forward,
2 + the ``d W`` pass backward: 4 in all). Memory beyond the outputs: ``[C, V_local]`` ``g``
of the chunk, ``[D, C, H]`` fp32 stack (``D = log2 K + 2``) and the fp32 ``d W``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.layers.loss.blocks import VOCAB_BLOCK, BlockLayout, fold_blocks
from mp_bridge.layers.loss.engines.triton_ops.block_dhidden import block_dhidden
from mp_bridge.layers.loss.engines.triton_ops.block_dweight import block_dweight_
from mp_bridge.layers.loss.engines.triton_ops.block_grad import block_grad
from mp_bridge.layers.loss.engines.triton_ops.block_stats import block_stats, row_tile
from mp_bridge.layers.loss.engines.triton_ops.tiles import kernel_column_weights
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.reduce import gather_fold

__all__ = ["DEFAULT_CHUNK_TOKENS", "FOLD_TOKENS", "TritonInvariantRunner"]

#: Tokens per chunk without ``chunk_size``: ``g`` is ``[1024, V_local]`` in the input
#: dtype (256 MiB at V_local = 131072 in bf16) plus the ``[D, 1024, H]`` fp32 stack.
DEFAULT_CHUNK_TOKENS = 1024
#: Tokens whose per-block statistics are folded at once (whole chunks): the fold's ~12
#: torch launches per tree level run once per group, not per chunk; ``[S, K, 8192]`` fp32
#: is 64 MiB at ``K = 512`` blocks, ``S = 4``. The fold is element-wise in the tokens: no
#: bit depends on the grouping.
FOLD_TOKENS = 8192


@dataclass(frozen=True, eq=False)
class TritonInvariantRunner:
    """The invariant runner: ``stats`` (forward) and ``grads`` (backward) of one call."""

    weight: torch.Tensor  # [V_local, H] (TP = 1: any number of rows)
    tp_group: dist.ProcessGroup | None
    layout: BlockLayout
    spec: LossSpec
    chunk: int  # tokens per chunk, a multiple of row_tile(weight.dtype)

    @classmethod
    def build(cls, weight, tp_group, shard, spec, chunk_size: int | None) -> TritonInvariantRunner:
        layout = BlockLayout.of_shard(shard)  # raises before any collective
        chunk, tile = chunk_size or DEFAULT_CHUNK_TOKENS, row_tile(weight.dtype)
        return cls(weight, tp_group, layout, spec, -(-chunk // tile) * tile)

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

    def stats(self, h: torch.Tensor, tcol: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        lay, spec, w, n = self.layout, self.spec, self.weight.detach(), h.shape[0]
        out = torch.empty((spec.num_stats, n), dtype=torch.float32, device=h.device)
        colw = self._colw
        group = max(self.chunk, FOLD_TOKENS // self.chunk * self.chunk)
        for g0 in range(0, n, group):  # fold whole groups of chunks: fewer torch launches
            g1 = min(g0 + group, n)
            st = None
            for rows in self._chunks(g1 - g0):
                at = slice(g0 + rows.start, g0 + rows.stop)
                part = block_stats(
                    h[at], w, temp[at], tcol[at], n_blocks=lay.num_local,
                    num_valid=self._num_valid, spec=spec, colw=colw,
                )  # fmt: skip
                if rows.stop - rows.start == g1 - g0:  # the group is one chunk
                    st = part
                    break
                if st is None:
                    st = part.new_empty((spec.num_stats, lay.num_local, g1 - g0))
                st[:, :, rows] = part
            pieces = fold_blocks(st, 1, lay, spec.merge)  # element-wise in the tokens
            shape = (spec.num_stats, g1 - g0)
            out[:, g0:g1] = gather_fold(pieces, lay, self.tp_group, spec.combine, shape, h.device)
        return out

    def grads(self, h, tcol, temp, lse, w, w_ent, ent, want_gw: bool, wab=None):
        lay, wt = self.layout, self.weight.detach()
        colw = None if wab is None else self._colw  # without wab: the unweighted kernels
        k, hd = lay.num_local, h.shape[1]
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        rows_w = min(k * VOCAB_BLOCK, wt.shape[0])
        acc = torch.zeros((rows_w, hd), dtype=torch.float32, device=h.device) if want_gw else None
        for rows in self._chunks(h.shape[0]):
            g = block_grad(
                h[rows], wt, temp[rows], tcol[rows], lse[rows], w[rows],
                None if w_ent is None else w_ent[rows], None if ent is None else ent[rows],
                n_blocks=k, num_valid=self._num_valid, spec=self.spec, colw=colw,
                wab=None if wab is None else (wab[0][rows], wab[1][rows]),
            )  # fmt: skip
            scratch = block_dhidden(g, wt, n_blocks=k, first=lay.first)
            pieces = list(zip(lay.pieces(lay.rank), scratch))
            shape = (rows.stop - rows.start, hd)
            gh[rows] = gather_fold(pieces, lay, self.tp_group, torch.Tensor.add_, shape, h.device)
            if acc is not None:
                block_dweight_(acc, g, h[rows])
            del g, scratch
        gw = None
        if want_gw:
            gw = acc.to(self.weight.dtype)  # one rounding of the fp32 sum
            if rows_w < self.weight.shape[0]:  # weight rows past the real blocks: padding
                gw = torch.cat([gw, gw.new_zeros((self.weight.shape[0] - rows_w, hd))])
        return gh, gw
