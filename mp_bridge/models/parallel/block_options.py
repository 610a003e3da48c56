"""Which transformer block a stack of :class:`TPBlock` s builds, read once from a config.

:class:`BlockOptions` holds the choices beside the sizes: grouped-query K/V heads, the
norm (LayerNorm / RMSNorm), the MLP (activation, or SwiGLU with a fused ``[gate; up]``),
the biases (q/k/v, attention output, MLP) and rotary positions. ``BlockOptions()`` is the
tiny model's block (LayerNorm, GELU MLP, full heads, no bias, no positions).
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.models.data.config import MimoConfig

__all__ = ["BlockOptions"]


@dataclass(frozen=True)
class BlockOptions:
    """``kv_heads`` (``None``: as many as query heads), ``norm`` (``"layernorm"`` /
    ``"rmsnorm"``), ``act`` (the MLP's, see :mod:`mp_bridge.layers.activations`),
    ``gated`` (SwiGLU: ``fc1`` is ``[gate; up]``, declared ``parts=2``), ``qkv_bias``,
    ``out_bias`` (attention output), ``mlp_bias`` (``fc1`` and ``fc2``), ``rope_theta``
    (``None``: no rotary positions)."""

    kv_heads: int | None = None
    norm: str = "layernorm"
    act: str = "gelu"
    gated: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float | None = None

    @classmethod
    def encoder(cls, cfg: MimoConfig) -> BlockOptions:
        """The vision tower's blocks: LayerNorm, ``enc_act``, biases per ``enc_bias``."""
        b = cfg.enc_bias
        return cls(act=cfg.enc_act, qkv_bias=b, out_bias=b, mlp_bias=b)

    @classmethod
    def llm(cls, cfg: MimoConfig) -> BlockOptions:
        """The LLM's blocks: ``llm_norm``, ``llm_mlp``, GQA, ``llm_qkv_bias``, RoPE."""
        return cls(
            kv_heads=cfg.kv_heads, norm=cfg.llm_norm, gated=cfg.llm_mlp == "swiglu",
            qkv_bias=cfg.llm_qkv_bias, rope_theta=cfg.rope_theta,
        )  # fmt: skip
