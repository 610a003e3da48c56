"""Rotary position embeddings (RoPE) on the tokens' original positions.

``apply_rotary(x, position_ids, theta)`` rotates ``x [b, s, heads, d]`` by the angles
``position · θ^(-2i/d)`` in Llama's "rotate half" layout (transformers'
``apply_rotary_pos_emb``: pairs ``(x_i, x_{i+d/2})``): ``x·cos + rotate_half(x)·sin`` with
``cos``/``sin`` of ``cat(freqs, freqs)``, computed in fp32 and applied in ``x``'s dtype.
Positions are the *original* ones (restarting per packed document, the CP cut's
non-contiguous runs), so a sharded sequence gets the rotation its tokens had whole.
Applied to q and k before the attention core (so a head-sharding all-to-all sees rotated
heads). Pure and local: no collectives; the adjoint is the inverse rotation (autograd).

Packed input gives attention positions along the packed stream (``[0, T)``, each document
a range of ``cu_seqlens``); :func:`rotary_positions` turns a packed layout's into
positions within their document, restarting at 0, as a document run alone has them.
Attention within a document only sees position *differences*, so the restart changes no
score in exact arithmetic; it keeps the fp32 angles those of the unpacked document (far
into a long packed stream, ``position · θ^(-2i/d)`` loses bits to the offset).
"""

from __future__ import annotations

import torch

from mp_bridge.comm.sequence.padding import PaddedLayout

__all__ = ["apply_rotary", "document_positions", "rotary_positions"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """``x [b, s, heads, d]`` rotated by ``position_ids`` (``[b, s]``, ``[1, s]`` or
    ``[s]``, integer) with base ``theta``; ``d`` must be even."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary positions need an even head dim, got {d}")
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.shape[-1] != x.shape[1]:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} for x of shape "
            f"{tuple(x.shape)} [b, s, heads, d]; give one position per token"
        )
    exponent = torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d
    inv_freq = 1.0 / (theta**exponent)  # [d/2], as transformers computes it
    freqs = position_ids.to(x.device, torch.float32)[..., None] * inv_freq  # [b, s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [b, s, 1, d]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def document_positions(position_ids: torch.Tensor, bounds) -> torch.Tensor:
    """``position_ids`` (any shape) minus the start of the document of ``bounds`` holding
    each (``[0, l0, l0+l1, ...]``, a sequence or LongTensor in the coordinates of the
    positions). Example: bounds ``[0, 3, 8]``, positions ``[2, 3, 4, 7]`` -> ``[2, 0, 1, 4]``."""
    device = position_ids.device
    bounds = torch.as_tensor(bounds, dtype=torch.long, device=device)
    doc = torch.searchsorted(bounds, position_ids.to(torch.long), right=True) - 1
    starts = bounds[doc.clamp(0, bounds.numel() - 2)]
    return position_ids - starts.to(position_ids.dtype)


def rotary_positions(position_ids: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
    """The positions RoPE rotates by: ``position_ids`` themselves (plain input, or packed
    input given by its raw bounds), or, for a packed :class:`PaddedLayout`
    (``ShardedBatch.layout``, whose ``position_ids`` are the *original* positions along the
    packed stream), their positions within their document: :func:`document_positions`
    over the layout's original ``bounds``. A padding token (its document's positions
    continued past its end) gets some position >= 0: no real query sees it."""
    if not isinstance(cu_seqlens, PaddedLayout) or not cu_seqlens.packed:
        return position_ids
    return document_positions(position_ids, cu_seqlens.bounds)
