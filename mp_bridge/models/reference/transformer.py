"""Transformer blocks of the single-process reference (plain torch), chosen by config.

Parameter names and layouts are the ones the distributed models shard from:

- ``attn.qkv`` rows are megatron's per-K/V-group interleave ``[hk, (g·q, k, v), d]``
  (``g = heads / kv_heads``): a contiguous row block is a set of whole K/V groups, which
  is what a column-parallel shard holds. With ``g = 1`` it is ``[heads, (q, k, v), d]``.
  Query head ``j·g + i`` uses K/V head ``j`` (transformers' ``repeat_kv`` order).
- ``mlp.fc1`` of a SwiGLU MLP is the fused ``[gate; up]`` (``2·ffn`` rows), ``fc2`` down.
- Rotary positions (``rope_theta``) rotate q and k by the tokens' original positions.

Tensors are batch-first ``[b, s, h]``. It uses no code of the distributed path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mp_bridge.layers import activation, apply_rotary, image_attention

__all__ = ["RefAttention", "RefBlock", "RefMLP", "ref_norm", "vision_stem"]


def vision_stem(tower: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[n, P, h]`` patch embeddings -> the tower's block input ``[n, P (+1), h]``: the
    class token first, learned positions, pre-norm, each as ``tower.cfg`` says (CLIP /
    SigLIP). The one stem of the reference and the TP towers (both hold the parameters
    ``class_token``, ``position_embedding``, ``pre_norm`` replicated)."""
    cfg = tower.cfg
    if cfg.enc_class_token:
        x = torch.cat([tower.class_token.expand(x.shape[0], 1, -1), x], dim=1)
    if cfg.enc_positions:
        x = x + tower.position_embedding
    return tower.pre_norm(x) if cfg.enc_pre_norm else x


def ref_norm(kind: str, hidden: int, eps: float) -> nn.Module:
    """``nn.LayerNorm`` (weight, bias) or ``nn.RMSNorm`` (weight) over ``hidden``."""
    return nn.RMSNorm(hidden, eps=eps) if kind == "rmsnorm" else nn.LayerNorm(hidden, eps=eps)


class RefAttention(nn.Module):
    """``[b, s, h] -> [b, s, h]``: fused qkv, optional RoPE, (grouped-query) SDPA, proj."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        causal: bool,
        kv_heads: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        rope_theta: float | None = None,
    ):
        super().__init__()
        self.heads, self.causal, self.rope_theta = heads, causal, rope_theta
        self.kv_heads = heads if kv_heads is None else kv_heads
        self.head_dim = hidden // heads
        rows = (heads + 2 * self.kv_heads) * self.head_dim
        self.qkv = nn.Linear(hidden, rows, bias=qkv_bias)
        self.proj = nn.Linear(hidden, hidden, bias=out_bias)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask`` (bool ``[s, s]``, True = attend) replaces the causal mask when given, so
        a causal stack's mask must hold the causality itself; a tuple of image token counts
        (``b = 1``) keeps attention inside each image (``image_attention``, no ``[s, s]``
        mask); ``position_ids`` ``[b|1, s]`` are needed with rotary positions."""
        b, s, h = x.shape
        g, d = self.heads // self.kv_heads, self.head_dim
        qkv = self.qkv(x).view(b, s, self.kv_heads, g + 2, d)
        q = qkv[:, :, :, :g].reshape(b, s, self.heads, d)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]  # [b, s, hk, d]
        if self.rope_theta is not None:
            q = apply_rotary(q, position_ids, self.rope_theta)
            k = apply_rotary(k, position_ids, self.rope_theta)
        if isinstance(mask, tuple):
            return self.proj(image_attention(q, k, v, mask).reshape(b, s, h))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        causal = self.causal and mask is None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=g > 1
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class RefMLP(nn.Module):
    """``[.., h] -> [.., out]``: ``fc2(act(fc1(x)))``, or SwiGLU ``fc2(silu(gate)·up)``
    with ``fc1`` the fused ``[gate; up]``."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        out: int | None = None,
        *,
        act: str = "gelu",
        bias: bool = False,
        gated: bool = False,
    ):
        super().__init__()
        self.act, self.gated = activation("silu" if gated else act), gated
        self.fc1 = nn.Linear(hidden, 2 * ffn if gated else ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden if out is None else out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(self.act(gate) * up)
        return self.fc2(self.act(self.fc1(x)))


class RefBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(x))``."""

    def __init__(self, attn: RefAttention, mlp: RefMLP, norm: str, hidden: int, eps: float):
        super().__init__()
        self.ln1 = ref_norm(norm, hidden, eps)
        self.attn = attn
        self.ln2 = ref_norm(norm, hidden, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, mask=None, position_ids=None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask, position_ids)
        return x + self.mlp(self.ln2(x))
