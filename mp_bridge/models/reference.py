"""The single-process reference MIMO model (plain torch): the oracle for every layout.

Parameter names and layouts are the ones the distributed models shard from:
``qkv`` rows are ordered ``[heads, (q, k, v), head_dim]`` so a contiguous row block is a
contiguous set of whole heads (Megatron's interleaved QKV), which is what a
column-parallel shard holds. Tensors are batch-first, ``[b, s, h]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import MimoConfig
from .placement import check_image_tokens, place_image_embeddings

__all__ = [
    "ReferenceEncoder",
    "ReferenceLLM",
    "ReferenceMimo",
    "ReferenceProjection",
    "reference_masked_mean",
]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, *, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, h // self.heads)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden if out is None else out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, *, causal: bool, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attn = _Attention(hidden, heads, causal=causal)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = _MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _trunk(n: int, hidden: int, heads: int, ffn: int, *, causal: bool, eps: float):
    """``n`` transformer blocks and the final norm (``blocks``, ``norm``) of a stack."""
    blocks = nn.ModuleList(_Block(hidden, heads, ffn, causal=causal, eps=eps) for _ in range(n))
    return blocks, nn.LayerNorm(hidden, eps=eps)


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


class ReferenceEncoder(nn.Module):
    """Patch embedding + bidirectional blocks + norm: [b, p, patch_dim] -> [b, p, enc_hidden]."""

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.enc_hidden)
        self.blocks, self.norm = _trunk(cfg.enc_layers, cfg.enc_hidden, cfg.enc_heads,
                                        cfg.enc_ffn, causal=False, eps=cfg.norm_eps)  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.norm(_run_blocks(self.blocks, self.patch_embed(images)))


class ReferenceProjection(_MLP):
    """Two-layer GELU MLP: [..., enc_hidden] -> [..., llm_hidden]."""

    def __init__(self, cfg: MimoConfig):
        super().__init__(cfg.enc_hidden, cfg.proj_hidden, cfg.llm_hidden)


class ReferenceLLM(nn.Module):
    """Embedding, causal blocks, final norm, untied head: [b, s, h] -> logits [b, s, V]."""

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.llm_hidden)
        self.blocks, self.norm = _trunk(cfg.llm_layers, cfg.llm_hidden, cfg.llm_heads,
                                        cfg.llm_ffn, causal=True, eps=cfg.norm_eps)  # fmt: skip
        self.head = nn.Linear(cfg.llm_hidden, cfg.vocab_size, bias=False)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(_run_blocks(self.blocks, embeddings)))


def reference_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over every token of the global batch (fp32)."""
    mask = mask.to(torch.float32)
    return (values.to(torch.float32) * mask).sum() / mask.sum().clamp(min=1.0)


class ReferenceMimo(nn.Module):
    """encoder -> projection -> place at image tokens -> LLM -> masked mean token loss."""

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = ReferenceEncoder(cfg)
        self.projection = ReferenceProjection(cfg)
        self.llm = ReferenceLLM(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        images: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Global mean cross-entropy over tokens with ``loss_mask`` set (scalar, fp32).

        ``input_ids``/``labels``/``loss_mask`` [B, S]; ``images`` [B, P, patch_dim] or None.
        """
        check_image_tokens(input_ids, self.cfg.image_token_id, self.cfg.num_patches)
        image = None if images is None else self.projection(self.encoder(images))
        embeddings = place_image_embeddings(
            self.llm.embed(input_ids), image, input_ids, self.cfg.image_token_id
        )
        logits = self.llm(embeddings)
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        ).view_as(labels)
        return reference_masked_mean(per_token, loss_mask)
