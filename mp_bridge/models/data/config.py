"""Sizes of the tiny reference MIMO model (one frozen spec shared by every model class)."""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.checks import check_int, check_positive_float

__all__ = ["MimoConfig"]


@dataclass(frozen=True)
class MimoConfig:
    """Sizes of the encoder, projection and LLM.

    The encoder sees ``num_patches`` patches of ``patch_dim`` features per image and emits
    one embedding per patch; the LLM reads ``seq_len`` tokens of which up to
    ``num_patches`` per sample are ``image_token_id`` placeholders replaced by those
    embeddings. Head counts and FFN widths must divide by the TP sizes used.
    """

    patch_dim: int = 12
    num_patches: int = 4
    enc_hidden: int = 16
    enc_heads: int = 8
    enc_ffn: int = 32
    enc_layers: int = 1
    proj_hidden: int = 32
    llm_hidden: int = 16
    llm_heads: int = 8
    llm_ffn: int = 32
    llm_layers: int = 2
    vocab_size: int = 61
    seq_len: int = 16
    image_token_id: int = 60
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        check_positive_float(
            "MimoConfig.norm_eps",
            self.norm_eps,
            fix="e.g. 1e-5 (the LayerNorm epsilon: <= 0 can divide by zero)",
        )
        for name, value in self.__dict__.items():
            if name == "norm_eps":
                continue
            check_int(f"MimoConfig.{name}", value, low=0)
        for hidden, heads, side in (
            (self.enc_hidden, self.enc_heads, "enc"),
            (self.llm_hidden, self.llm_heads, "llm"),
        ):
            if heads < 1 or hidden % heads:
                raise ValueError(
                    f"MimoConfig.{side}_hidden={hidden} must be a multiple of "
                    f"{side}_heads={heads}; pick heads dividing the hidden size"
                )
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"MimoConfig.image_token_id={self.image_token_id} must be a vocab id in "
                f"[0, {self.vocab_size}); the placeholder is embedded before being replaced"
            )
        if self.num_patches > self.seq_len:
            raise ValueError(
                f"MimoConfig.num_patches={self.num_patches} exceeds seq_len={self.seq_len}; "
                "the image tokens must fit in the sequence"
            )

    @property
    def encoder_cost_c(self) -> float:
        """``c`` of the balance plan's image cost ``t² + c·t`` for this encoder: per token
        the linears weigh ``2·enc_hidden + enc_ffn`` against attention's ``t`` per token."""
        return 2.0 * self.enc_hidden + self.enc_ffn

    def check_tp(self, *, encoder_tp: int = 1, llm_tp: int = 1) -> None:
        """Raise ``ValueError`` naming the size when a TP size does not divide the model."""
        checks = (
            ("enc_heads", self.enc_heads, encoder_tp, "encoder tp"),
            ("enc_ffn", self.enc_ffn, encoder_tp, "encoder tp"),
            ("proj_hidden", self.proj_hidden, encoder_tp, "encoder tp"),
            ("llm_heads", self.llm_heads, llm_tp, "llm tp"),
            ("llm_ffn", self.llm_ffn, llm_tp, "llm tp"),
        )
        for name, value, tp, axis in checks:
            if value % tp:
                raise ValueError(
                    f"MimoConfig.{name}={value} is not divisible by {axis}={tp}; "
                    f"choose a {name} that is a multiple of {tp}"
                )
