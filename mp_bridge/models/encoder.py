"""TP vision encoder and projection (megatron-core parallel linears, explicit ``tp_group``).

Both run on the encoder's DP shard with batch-first ``[b, p, h]`` tensors at the module
boundary; outputs are TP-replicated (each MLP/attention ends in a row-parallel linear,
whose forward all-reduces over TP). Collectives per forward: 2 TP all-reduces per block
plus 1 for the projection; the same count in backward (megatron's *f* before each column
linear). Gradients of replicated parameters (patch embedding, norms) are identical on
every TP rank; every parameter gradient is partial over the encoder DP group (summed by
the MIMO model's gradient sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_bridge.comm import group_size

from .config import MimoConfig
from .groups import check_group
from .sharding import FullStateMixin
from .tp_blocks import TPMLP, make_blocks, make_norm, parallel_config

__all__ = ["TPEncoder", "TPProjection", "bidirectional_attention"]


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention on local heads, ``[b, s, heads, d]``; no collectives."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class TPEncoder(FullStateMixin, nn.Module):
    """``images [b, p, patch_dim] -> [b, p, enc_hidden]``, TP-replicated output.

    Parameter names equal :class:`ReferenceEncoder`'s, so :meth:`from_full` /
    :meth:`to_full` round-trip a single-process model's ``state_dict``.
    """

    def __init__(
        self,
        cfg: MimoConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        check_group(tp_group, "tp_group")
        cfg.check_tp(encoder_tp=group_size(tp_group))
        self.cfg, self.tp_group = cfg, tp_group
        config = parallel_config(tp_group)
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.enc_hidden)  # replicated over TP
        self.blocks = make_blocks(
            cfg.enc_layers, cfg.enc_hidden, cfg.enc_heads, cfg.enc_ffn, eps=cfg.norm_eps,
            tp_group=tp_group, config=config, core=bidirectional_attention, device=device,
        )  # fmt: skip
        self.norm = make_norm(cfg.enc_hidden, cfg.norm_eps, device=device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 3 or images.shape[-1] != self.cfg.patch_dim:
            raise ValueError(
                f"images must be [batch, patches, patch_dim={self.cfg.patch_dim}]; got "
                f"{tuple(images.shape)}"
            )
        x = self.patch_embed(images).transpose(0, 1)  # blocks are sequence-first
        for block in self.blocks:
            x = block(x)
        return self.norm(x).transpose(0, 1)


class TPProjection(FullStateMixin, TPMLP):
    """``[.., enc_hidden] -> [.., llm_hidden]``: column ``fc1``, GELU, row ``fc2`` in the
    encoder's TP group; input and output TP-replicated."""

    def __init__(
        self,
        cfg: MimoConfig,
        *,
        tp_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,  # no device-specific layer; kept for from_full
    ):
        check_group(tp_group, "tp_group")
        cfg.check_tp(encoder_tp=group_size(tp_group))
        super().__init__(
            cfg.enc_hidden, cfg.proj_hidden, cfg.llm_hidden,
            tp_group=tp_group, config=parallel_config(tp_group),
        )  # fmt: skip
        self.tp_group = tp_group
