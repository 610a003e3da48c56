"""The single-process reference MIMO model (plain torch): the oracle for every layout.

Parameter names and layouts are the ones the distributed models shard from:
``qkv`` rows are ordered ``[heads, (q, k, v), head_dim]`` so a contiguous row block is a
contiguous set of whole heads (Megatron's interleaved QKV), which is what a
column-parallel shard holds. Tensors are batch-first, ``[b, s, h]``; ragged images
(:class:`RaggedImages`) run as one flat sequence with attention kept inside each image.
Packed text (``cu_seqlens``) runs as one ``[1, T, h]`` sequence under a dense
block-diagonal causal mask (:func:`packed_causal_mask`): each document attends only to
its own earlier tokens, exactly as if it ran alone (checked against per-document runs in
``tests/unit/test_models_packed.py``). It uses no code of the distributed path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mp_bridge.layers import image_attention
from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import BatchSpec, StepInputs, parse_step_inputs
from mp_bridge.models.data.placement import place_images

__all__ = [
    "ReferenceEncoder",
    "ReferenceLLM",
    "ReferenceMimo",
    "ReferenceProjection",
    "packed_causal_mask",
    "reference_masked_mean",
]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, *, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        """``mask``: a bool ``[s, s]`` (True = attend) that replaces the causal mask, so a
        causal stack's mask holds the causality itself (:func:`packed_causal_mask`); or a
        tuple of image token counts (``b = 1``): attention inside each image
        (``image_attention``, no ``[s, s]`` mask)."""
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, self.heads, 3, h // self.heads)
        if isinstance(mask, tuple):
            q, k, v = (qkv[:, :, :, i] for i in range(3))  # [b, s, heads, d]
            return self.proj(image_attention(q, k, v, mask).reshape(b, s, h))
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # [b, heads, s, d]
        causal = self.causal and mask is None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


def _trunk(n: int, hidden: int, heads: int, ffn: int, *, causal: bool, eps: float):
    """``n`` transformer blocks and the final norm (``blocks``, ``norm``) of a stack."""
    blocks = nn.ModuleList(_Block(hidden, heads, ffn, causal=causal, eps=eps) for _ in range(n))
    return blocks, nn.LayerNorm(hidden, eps=eps)


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, mask=None) -> torch.Tensor:
    for block in blocks:
        x = block(x, mask)
    return x


class ReferenceEncoder(nn.Module):
    """Patch embedding + bidirectional blocks + norm: [b, p, patch_dim] -> [b, p, enc_hidden],
    or ragged images -> [T, enc_hidden] (one sequence, attention inside each image)."""

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.enc_hidden)
        self.blocks, self.norm = _trunk(cfg.enc_layers, cfg.enc_hidden, cfg.enc_heads,
                                        cfg.enc_ffn, causal=False, eps=cfg.norm_eps)  # fmt: skip

    def forward(self, images: torch.Tensor | RaggedImages) -> torch.Tensor:
        if isinstance(images, RaggedImages):
            x = self.patch_embed(images.tokens).unsqueeze(0)
            return self.norm(_run_blocks(self.blocks, x, images.lengths())).squeeze(0)
        return self.norm(_run_blocks(self.blocks, self.patch_embed(images)))


class ReferenceProjection(_MLP):
    """Two-layer GELU MLP: [..., enc_hidden] -> [..., llm_hidden]."""

    def __init__(self, cfg: MimoConfig):
        super().__init__(cfg.enc_hidden, cfg.proj_hidden, cfg.llm_hidden)


def packed_causal_mask(cu_seqlens: torch.Tensor, device=None) -> torch.Tensor:
    """Bool ``[T, T]``: query ``i`` sees key ``j`` iff both lie in the same document of
    ``cu_seqlens`` (``[0, l0, l0+l1, ..., T]``) and ``j <= i``. Dense (``T^2``), for the
    small reference. Example ``cu_seqlens = [0, 2, 3]``: rows ``[1,0,0], [1,1,0], [0,0,1]``."""
    cu = cu_seqlens.to("cpu", torch.int64)
    doc = torch.arange(len(cu) - 1).repeat_interleave(cu.diff())
    pos = torch.arange(int(cu[-1]))
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    return mask.to(device)


class ReferenceLLM(nn.Module):
    """Embedding, causal blocks, final norm, untied head: [b, s, h] -> logits [b, s, V].

    ``mask`` (bool ``[s, s]``) replaces the causal mask, e.g. :func:`packed_causal_mask`.
    """

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.llm_hidden)
        self.blocks, self.norm = _trunk(cfg.llm_layers, cfg.llm_hidden, cfg.llm_heads,
                                        cfg.llm_ffn, causal=True, eps=cfg.norm_eps)  # fmt: skip
        self.head = nn.Linear(cfg.llm_hidden, cfg.vocab_size, bias=False)

    def forward(self, embeddings: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.norm(_run_blocks(self.blocks, embeddings, mask)))


def reference_masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over every token of the global batch (fp32)."""
    mask = mask.to(torch.float32)
    return (values.to(torch.float32) * mask).sum() / mask.sum().clamp(min=1.0)


class ReferenceMimo(nn.Module):
    """encoder -> projection -> place at image tokens -> LLM -> masked mean token loss.

    ``forward(input_ids, labels, loss_mask, images=None, *, cu_seqlens=None)`` on the
    global batch: ``images`` ``[B, P, patch_dim]``, :class:`RaggedImages` or None; text
    ``[B, S]`` rows, or packed ``[T]`` documents bounded by ``cu_seqlens`` (each its own
    causal sequence; the loss is the masked mean over every token of every document).
    The same stages and placement math as the colocated model's gather flow, in one
    process on the full tensors.
    """

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.cfg = cfg
        self.image_token_id = cfg.image_token_id
        self.encoder = ReferenceEncoder(cfg)
        self.projection = ReferenceProjection(cfg)
        self.llm = ReferenceLLM(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        images: torch.Tensor | RaggedImages | None = None,
        *,
        cu_seqlens: torch.Tensor | list[int] | None = None,
    ) -> torch.Tensor:
        """Global masked-mean token loss (fp32 scalar) of the whole batch."""
        spec = BatchSpec.of(self.cfg, self.image_token_id)
        inputs = parse_step_inputs(
            input_ids, labels, loss_mask, images, cu_seqlens, spec, images_of_text=True
        )
        return self.step_loss(inputs)

    def step_loss(self, inputs: StepInputs) -> torch.Tensor:
        """The loss of parsed inputs (:func:`parse_step_inputs`)."""
        image, counts = None, None
        if inputs.has_images:
            image = self.projection(self.encoder(inputs.images))
            counts = inputs.images.tokens_per_sample if inputs.ragged else None
        embeddings = place_images(self.llm.embed, inputs, image, counts)
        mask = None
        if inputs.packed:  # one packed row [1, T, h]: documents kept apart
            mask = packed_causal_mask(inputs.cu_seqlens, embeddings.device)
        logits = self.llm(embeddings, mask)
        labels = inputs.labels
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        ).view_as(labels)
        return reference_masked_mean(per_token, inputs.loss_mask)
