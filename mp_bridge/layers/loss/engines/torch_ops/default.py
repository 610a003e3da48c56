"""The torch engine's default runner (``invariant=False``): the whole local shard per
chunk, ``z = h @ W^T`` ``[C, V_local]`` in slabs of weight rows; one statistics
all-gather and one ``d h`` all-reduce per chunk over TP (``reduce``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.layers.loss.blocks import shard_columns
from mp_bridge.layers.loss.class_weights import column_weights, target_weights
from mp_bridge.layers.loss.engines.torch_ops.driver import ChunkState
from mp_bridge.layers.loss.formulas import (
    LossSpec,
    row_stats_,
    stats_values,
    transform_logits_,
)
from mp_bridge.layers.loss.grad import softmax_grad_rows_
from mp_bridge.layers.loss.outputs import TokenOutputs
from mp_bridge.layers.loss.reduce import all_reduce_sum_, gather_merge_stats
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = ["SLAB_ROWS", "TorchDefaultRunner"]


#: Weight rows per logits matmul of the default runner: MKL computes a ``[V_local, H] x [H,
#: C]`` product about 9 % faster in slabs of 512-2048 rows than in one call at ``V_local =
#: 65536`` (bench/lm_head_gemm_shapes.py); each output element is the same K = H dot
#: product, with the same bits (checked there).
SLAB_ROWS = 2048


def _accumulate_weight_grad(gw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``gw += g^T @ h`` with ``gw`` fp32 whatever the dtype of ``g``/``h``."""
    if g.dtype == torch.float32:
        gw.addmm_(g.t(), h)
    else:
        gw.add_(torch.mm(g.t(), h).float())


@dataclass(frozen=True, eq=False)
class TorchDefaultRunner:
    """Whole shard per chunk: ``z = h @ W^T`` is ``[C, V_local]``, in slabs of weight rows.

    The logits are stored vocab-major (``z`` is the ``[C, V_local]`` transpose of a
    contiguous ``[V_local, C]`` product ``W h^T``): no operand of the three GEMMs is then
    a transposed weight (MKL's slowest case here), and ``d W += g^T h`` reads ``g^T``
    contiguously; the row math is layout-agnostic.
    """

    weight: torch.Tensor
    tp_group: dist.ProcessGroup | None
    shard: VocabShard
    spec: LossSpec

    def _logits(self, h: torch.Tensor, temp=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, ht = self.weight.detach(), h.t()
        # an empty shard (a DTensor's last ranks, dtensor_weight): one padding column
        zt = torch.empty((max(w.shape[0], 1), h.shape[0]), dtype=h.dtype, device=h.device)
        if not w.shape[0]:
            zt.zero_()
        for v in range(0, w.shape[0], SLAB_ROWS):  # (V_local, H) @ (H, C), slab by slab
            torch.mm(w[v : v + SLAB_ROWS], ht, out=zt[v : v + SLAB_ROWS])
        z = (zt if zt.dtype == torch.float32 else zt.float()).t()  # keeps the layout
        deriv = transform_logits_(z, self.spec, None if temp is None else temp.unsqueeze(1))
        if deriv is not None:
            deriv[:, self.shard.num_real :] = 0.0  # padding columns (the weight's padding rows)
        return z, deriv

    def forward_chunk(
        self, h: torch.Tensor, t: torch.Tensor, temp=None
    ) -> tuple[ChunkState, TokenOutputs]:
        z, deriv = self._logits(h, temp)
        col = shard_columns(t, self.shard)
        spec = self.spec
        colw = column_weights(spec, self.shard.start, z.shape[1])
        stats, m = row_stats_(z, col, self.shard.num_real, spec, colw=colw)
        merged = gather_merge_stats(stats, self.tp_group, spec.merge)  # z <- exp(z - m)
        out = stats_values(merged, spec, omega=target_weights(spec, t))
        return ChunkState(z, m, None, deriv), out

    def recompute(self, h: torch.Tensor, temp=None) -> ChunkState:
        z, deriv = self._logits(h, temp)
        return ChunkState(z, None, None, deriv)

    def grad_chunk(
        self, state, h, t, lse, w, gw: torch.Tensor | None, *, entropy=None, w_ent=None
    ) -> torch.Tensor:
        z, m = state.logits, state.row_max
        valid = self.shard.num_real
        if m is None:  # raw logits (backward recompute): softmax = exp(z - lse)
            if valid < z.shape[1]:
                z[:, valid:] = float("-inf")
            p = z.sub_(lse.unsqueeze(1)).exp_()
        else:  # exp(z - m) from forward: softmax = exp(z - m) * exp(m - lse)
            p = z.mul_(torch.exp(m - lse).unsqueeze(1))
        col = shard_columns(t, self.shard)
        spec = self.spec
        weights = {
            "omega": target_weights(spec, t),
            "colw": column_weights(spec, self.shard.start, p.shape[1]),
        }
        g = softmax_grad_rows_(
            p, col, w, spec, valid, lse=lse, entropy=entropy, w_ent=w_ent, **weights
        )
        if state.deriv is not None:
            g.mul_(state.deriv)
        g = g.to(h.dtype)[:, : self.weight.shape[0]]  # an empty shard: no padding column
        if gw is not None:
            _accumulate_weight_grad(gw, g, h)
        gh = torch.mm(g, self.weight)  # (C, V_local) @ (V_local, H): this shard's part
        gh = gh if gh.dtype == torch.float32 else gh.float()
        return all_reduce_sum_(gh, self.tp_group)
