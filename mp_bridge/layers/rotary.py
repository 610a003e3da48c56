"""Rotary position embeddings (RoPE) on the tokens' original positions.

``apply_rotary(x, position_ids, theta)`` rotates ``x [b, s, heads, d]`` by the angles
``position · θ^(-2i/d)`` in Llama's "rotate half" layout (transformers'
``apply_rotary_pos_emb``: pairs ``(x_i, x_{i+d/2})``): ``x·cos + rotate_half(x)·sin`` with
``cos``/``sin`` of ``cat(freqs, freqs)``, computed in fp32 and applied in ``x``'s dtype.
Positions are the *original* ones (restarting per packed document, the CP cut's
non-contiguous runs), so a sharded sequence gets the rotation its tokens had whole.
Applied to q and k before the attention core (so a head-sharding all-to-all sees rotated
heads). Pure and local: no collectives; the adjoint is the inverse rotation (autograd).
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


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
