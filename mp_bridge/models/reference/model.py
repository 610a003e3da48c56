"""The single-process reference MIMO model (plain torch): the oracle for every layout.

Parameter names and layouts are the ones the distributed models shard from (the blocks'
layouts: :mod:`mp_bridge.models.reference.transformer`; ``qkv`` is megatron's per-K/V-group
interleave, so a contiguous row block is a set of whole heads). Tensors are batch-first,
``[b, s, h]``; ragged images (:class:`RaggedImages`) run as one flat sequence with
attention kept inside each image.
Packed text (``cu_seqlens``) runs as one ``[1, T, h]`` sequence under a dense
block-diagonal causal mask (:func:`packed_causal_mask`): each document attends only to
its own earlier tokens, exactly as if it ran alone, with rotary positions restarting per
document (checked against per-document runs in
``tests/unit/test_models_packed.py``). It uses no code of the distributed path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mp_bridge.models.data.config import MimoConfig
from mp_bridge.models.data.images import RaggedImages
from mp_bridge.models.data.inputs import (
    BatchSpec,
    StepInputs,
    image_output_counts,
    parse_step_inputs,
)
from mp_bridge.models.data.placement import place_images
from mp_bridge.models.reference.transformer import (
    RefAttention,
    RefBlock,
    RefMLP,
    ref_norm,
    vision_stem,
)

__all__ = [
    "ReferenceEncoder",
    "ReferenceLLM",
    "ReferenceMimo",
    "ReferenceProjection",
    "packed_causal_mask",
    "reference_masked_mean",
]


def encoder_block(cfg: MimoConfig) -> RefBlock:
    """One bidirectional encoder block of ``cfg`` (LayerNorm, biases per ``enc_bias``)."""
    h, bias = cfg.enc_hidden, cfg.enc_bias
    attn = RefAttention(h, cfg.enc_heads, causal=False, qkv_bias=bias, out_bias=bias)
    mlp = RefMLP(h, cfg.enc_ffn, act=cfg.enc_act, bias=bias)
    return RefBlock(attn, mlp, "layernorm", h, cfg.encoder_norm_eps)


def llm_block(cfg: MimoConfig) -> RefBlock:
    """One causal LLM block of ``cfg`` (norm, MLP, GQA, qkv bias and RoPE per config)."""
    h = cfg.llm_hidden
    attn = RefAttention(
        h, cfg.llm_heads, causal=True, kv_heads=cfg.kv_heads, qkv_bias=cfg.llm_qkv_bias,
        rope_theta=cfg.rope_theta,
    )  # fmt: skip
    mlp = RefMLP(h, cfg.llm_ffn, gated=cfg.llm_mlp == "swiglu")
    return RefBlock(attn, mlp, cfg.llm_norm, h, cfg.norm_eps)


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, mask=None, position_ids=None):
    for block in blocks:
        x = block(x, mask, position_ids)
    return x


class ReferenceEncoder(nn.Module):
    """Vision tower: ``[b, P, patch_dim] -> [b, image_placeholders, enc_hidden]``, or ragged
    images -> ``[T_out, enc_hidden]``.

    Patch embedding (one linear over flattened patches), then as ``cfg`` says: class token
    first, learned positions added, pre-norm; ``enc_layers`` bidirectional blocks; the
    final norm; ``"default"`` drops the first output token. Ragged images of the tiny model
    run as one sequence with attention kept inside each image; with a fixed image size
    (:attr:`MimoConfig.fixed_image_size`) they run as an ``[n, P, patch_dim]`` batch.
    """

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.enc_hidden
        self.patch_embed = nn.Linear(cfg.patch_dim, h, bias=cfg.enc_patch_bias)
        if cfg.enc_class_token:
            self.class_token = nn.Parameter(torch.randn(h) * 0.02)
        if cfg.enc_positions:
            self.position_embedding = nn.Parameter(torch.randn(cfg.encoder_positions, h) * 0.02)
        if cfg.enc_pre_norm:
            self.pre_norm = nn.LayerNorm(h, eps=cfg.encoder_norm_eps)
        self.blocks = nn.ModuleList(encoder_block(cfg) for _ in range(cfg.enc_layers))
        if cfg.enc_final_norm:
            self.norm = nn.LayerNorm(h, eps=cfg.encoder_norm_eps)

    def forward(self, images: torch.Tensor | RaggedImages) -> torch.Tensor:
        cfg = self.cfg
        if isinstance(images, RaggedImages) and cfg.fixed_image_size:
            n = len(images.tokens_per_image)
            out = self(images.tokens.view(n, cfg.num_patches, cfg.patch_dim))
            return out.reshape(-1, out.shape[-1])
        if isinstance(images, RaggedImages):
            x = self.patch_embed(images.tokens).unsqueeze(0)
            x = _run_blocks(self.blocks, x, images.lengths())
            return (self.norm(x) if cfg.enc_final_norm else x).squeeze(0)
        x = _run_blocks(self.blocks, vision_stem(self, self.patch_embed(images)))  # [b, P, h]
        if cfg.enc_final_norm:
            x = self.norm(x)
        return x[:, 1:] if cfg.enc_feature_select == "default" else x


class ReferenceProjection(RefMLP):
    """Two-layer GELU MLP: [..., enc_hidden] -> [..., llm_hidden] (biases per ``proj_bias``)."""

    def __init__(self, cfg: MimoConfig):
        super().__init__(cfg.enc_hidden, cfg.proj_hidden, cfg.llm_hidden, bias=cfg.proj_bias)


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
    """Embedding, causal blocks, final norm, head: [b, s, h] -> logits [b, s, V].

    ``mask`` (bool ``[s, s]``) replaces the causal mask, e.g. :func:`packed_causal_mask`;
    ``position_ids`` (``[b|1, s]``, the tokens' original positions) feed rotary positions.
    With ``tie_embeddings`` the head's weight is the embedding's (one parameter).
    """

    def __init__(self, cfg: MimoConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.llm_hidden)
        self.blocks = nn.ModuleList(llm_block(cfg) for _ in range(cfg.llm_layers))
        self.norm = ref_norm(cfg.llm_norm, cfg.llm_hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.llm_hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(
        self,
        embeddings: torch.Tensor,
        mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.head(self.norm(_run_blocks(self.blocks, embeddings, mask, position_ids)))


def reference_positions(inputs: StepInputs, device=None) -> torch.Tensor:
    """Original positions ``[b, S]`` (plain) or ``[1, T]`` restarting per packed document."""
    if not inputs.packed:
        b, s = inputs.input_ids.shape
        return torch.arange(s, device=device).expand(b, s)
    cu = inputs.cu_seqlens
    starts = cu[:-1].repeat_interleave(cu.diff())
    return (torch.arange(int(cu[-1])) - starts).unsqueeze(0).to(device)


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
        self.spec = BatchSpec.of(cfg)
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
        inputs = parse_step_inputs(
            input_ids, labels, loss_mask, images, cu_seqlens, self.spec, images_of_text=True
        )
        return self.step_loss(inputs)

    def step_loss(self, inputs: StepInputs) -> torch.Tensor:
        """The loss of parsed inputs (:func:`parse_step_inputs`)."""
        image, counts = None, None
        if inputs.has_images:
            image = self.projection(self.encoder(inputs.images))
            counts = image_output_counts(inputs.images, self.spec) if inputs.ragged else None
        embeddings = place_images(self.llm.embed, inputs, image, counts)
        mask = None
        if inputs.packed:  # one packed row [1, T, h]: documents kept apart
            mask = packed_causal_mask(inputs.cu_seqlens, embeddings.device)
        logits = self.llm(embeddings, mask, reference_positions(inputs, embeddings.device))
        labels = inputs.labels
        per_token = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="none"
        ).view_as(labels)
        return reference_masked_mean(per_token, inputs.loss_mask)
