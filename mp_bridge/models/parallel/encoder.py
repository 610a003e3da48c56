"""TP vision encoder and projection (megatron-core parallel linears, explicit ``tp_group``).

Both run on the encoder's DP shard with batch-first ``[b, p, h]`` tensors at the module
boundary, or on ragged images (:class:`RaggedImages`: flat ``[T, h]`` tokens, attention
inside each image by ``image_attention``, so the math is the reference's);
outputs are TP-replicated (each MLP/attention ends in a row-parallel linear, whose
forward all-reduces over TP). Collectives per forward: 2 TP all-reduces per block plus 1
for the projection; the same count in backward (megatron's *f* before each column
linear). Gradients of replicated parameters (patch embedding, norms) are identical on
every TP rank; every parameter gradient is partial over the encoder DP group (summed by
the MIMO model's gradient sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_bridge.checks import check_group
from mp_bridge.comm import group_size
from mp_bridge.layers import image_attention
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.parallel.block_options import BlockOptions
from mp_bridge.models.parallel.sharding import FullStateMixin
from mp_bridge.models.parallel.tp_blocks import TPMLP, make_blocks, make_norm, parallel_config
from mp_bridge.models.reference.transformer import vision_stem

__all__ = ["TPEncoder", "TPProjection", "bidirectional_attention"]


def bidirectional_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, images: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Non-causal attention on local heads, ``[b, s, heads, d]``: over the whole sequence,
    or (``images``: token counts, ``b = 1``) inside each image (``image_attention``, no
    ``[s, s]`` mask). No collectives."""
    if images is not None:
        return image_attention(q, k, v, images)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


class TPEncoder(FullStateMixin, nn.Module):
    """``images [b, p, patch_dim] -> [b, p, enc_hidden]``, or ragged images (flat
    ``[T, patch_dim]`` tokens) ``-> [T, enc_hidden]``; TP-replicated output. A tower with a
    fixed image size (CLIP / SigLIP: :attr:`MimoConfig.fixed_image_size`) runs every image
    as a batch row ``[n, P, patch_dim] -> [n, image_placeholders, enc_hidden]`` (ragged:
    flattened back to ``[n · image_placeholders, enc_hidden]``).

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
        check_group("tp_group", tp_group)
        cfg.check_tp(encoder_tp=group_size(tp_group))
        self.cfg, self.tp_group = cfg, tp_group
        config = parallel_config(tp_group)
        h, eps = cfg.enc_hidden, cfg.encoder_norm_eps
        # Replicated over TP: patch embedding, class token, positions, norms.
        self.patch_embed = nn.Linear(cfg.patch_dim, h, bias=cfg.enc_patch_bias)
        if cfg.enc_class_token:
            self.class_token = nn.Parameter(torch.zeros(h))
        if cfg.enc_positions:
            self.position_embedding = nn.Parameter(torch.zeros(cfg.encoder_positions, h))
        if cfg.enc_pre_norm:
            self.pre_norm = make_norm(h, eps, device=device)
        self.blocks = make_blocks(
            cfg.enc_layers, h, cfg.enc_heads, cfg.enc_ffn, eps=eps, tp_group=tp_group,
            config=config, core=bidirectional_attention, device=device,
            options=BlockOptions.encoder(cfg),
        )  # fmt: skip
        if cfg.enc_final_norm:
            self.norm = make_norm(h, eps, device=device)

    def _fixed_size(self, images: torch.Tensor) -> torch.Tensor:
        """``[n, P, patch_dim] -> [n, image_placeholders, h]``: class token, positions,
        pre-norm, blocks (one image per batch row: attention stays inside it), select."""
        cfg = self.cfg
        x = vision_stem(self, self.patch_embed(images)).transpose(0, 1)  # sequence-first
        for block in self.blocks:
            x = block(x)
        x = (self.norm(x) if cfg.enc_final_norm else x).transpose(0, 1)
        return x[:, 1:] if cfg.enc_feature_select == "default" else x

    def forward(self, images: torch.Tensor | RaggedImages) -> torch.Tensor:
        cfg = self.cfg
        if cfg.fixed_image_size:
            ragged = isinstance(images, RaggedImages)
            x = images.tokens.view(-1, cfg.num_patches, cfg.patch_dim) if ragged else images
            if x.dim() != 3 or x.shape[1:] != (cfg.num_patches, cfg.patch_dim):
                raise ValueError(
                    f"images must be [batch, num_patches={cfg.num_patches}, patch_dim="
                    f"{cfg.patch_dim}] or RaggedImages of such images; got {tuple(x.shape)}"
                )
            out = self._fixed_size(x)
            return out.reshape(-1, out.shape[-1]) if ragged else out
        if isinstance(images, RaggedImages):
            # One sequence of T tokens (batch 1), attention kept inside each image.
            x, lengths = images.tokens.unsqueeze(1), images.lengths()
        else:
            x, lengths = images.transpose(0, 1), None  # blocks are sequence-first
        if x.dim() != 3 or x.shape[-1] != self.cfg.patch_dim:
            raise ValueError(
                f"images must be [batch, patches, patch_dim={self.cfg.patch_dim}] or "
                f"RaggedImages of [T, patch_dim] tokens; got {tuple(x.shape)} (seq-first)"
            )
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x, images=lengths)
        x = self.norm(x) if cfg.enc_final_norm else x
        return x.squeeze(1) if lengths is not None else x.transpose(0, 1)


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
        check_group("tp_group", tp_group)
        cfg.check_tp(encoder_tp=group_size(tp_group))
        super().__init__(
            cfg.enc_hidden, cfg.proj_hidden, cfg.llm_hidden,
            tp_group=tp_group, config=parallel_config(tp_group), bias=cfg.proj_bias,
        )  # fmt: skip
        self.tp_group = tp_group
