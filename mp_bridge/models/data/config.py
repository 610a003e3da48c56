"""Sizes and block choices of the reference MIMO model (one frozen spec shared by every
model class). The defaults are the tiny test model; :func:`mp_bridge.models.hf.config_from_hf`
fills the same fields from a LLaVA checkpoint (CLIP / SigLIP vision, Llama / Qwen2 /
Mistral text)."""

from __future__ import annotations

from dataclasses import dataclass

from mp_bridge.checks import check_bool, check_choice, check_int, check_positive_float

__all__ = ["ENCODER_ACTIVATIONS", "MimoConfig"]

#: The encoder MLP's activation: ``"gelu"`` (erf), CLIP's ``"quick_gelu"``
#: (``x·sigmoid(1.702x)``), SigLIP's ``"gelu_pytorch_tanh"`` (tanh approximation).
ENCODER_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh")

_BOOLS = (
    "enc_bias", "enc_patch_bias", "enc_class_token", "enc_pre_norm", "enc_positions",
    "enc_final_norm", "proj_bias", "llm_qkv_bias", "tie_embeddings",
)  # fmt: skip
_FLOATS = ("norm_eps", "enc_norm_eps", "rope_theta")
#: Fields whose ``None`` means "derived" (see the properties of the same meaning).
_DERIVED = ("image_placeholders", "llm_kv_heads")
_CHOICES = {
    "enc_act": ENCODER_ACTIVATIONS,
    "enc_feature_select": ("full", "default"),
    "llm_norm": ("layernorm", "rmsnorm"),
    "llm_mlp": ("gelu", "swiglu"),
}


@dataclass(frozen=True)
class MimoConfig:
    """Sizes of the encoder, projection and LLM, and the kind of each block.

    **Images.** The encoder reads ``num_patches`` patches of ``patch_dim`` features per
    image (its input tokens: a ``[C, H, W]`` image is ``(H/p)·(W/p)`` patches of
    ``C·p·p`` values, ``C = image_channels``, :func:`mp_bridge.models.hf.pixel_patches`)
    and emits
    ``image_placeholders`` embeddings per image: ``num_patches``, plus one with
    ``enc_class_token`` (CLIP), minus one with ``enc_feature_select="default"`` (drops the
    first output token whatever the tower). ``image_placeholders`` is checked when given;
    :attr:`placeholders_per_image` is the value (derived when ``None``). The LLM reads
    ``seq_len`` tokens, where each image is
    a run of ``image_placeholders`` ``image_token_id`` placeholders (the tiny model:
    ``num_patches`` each).

    **Encoder blocks** (``enc_layers`` of them are built and run: HF's
    ``vision_feature_layer`` is resolved into this count, later layers are not built):
    patch embedding (a linear over flattened patches, bias ``enc_patch_bias``), optional
    class token (``enc_class_token``), learned positions (``enc_positions``), pre-norm
    (``enc_pre_norm``), pre-LN blocks with LayerNorm (``enc_norm_eps``, ``None``:
    ``norm_eps``; :attr:`encoder_norm_eps`), q/k/v/out and fc1/fc2 biases (``enc_bias``)
    and ``enc_act``, then a final
    LayerNorm when ``enc_final_norm`` (LLaVA reads the features before CLIP's / SigLIP's
    ``post_layernorm``, so its configs set it False).

    **Projection**: linear, GELU (erf), linear (``proj_bias``).

    **LLM blocks**: ``llm_norm`` (LayerNorm or RMSNorm, eps ``norm_eps``), ``llm_mlp``
    (GELU MLP, or SwiGLU with fused ``[gate; up]`` rows), grouped-query attention with
    ``llm_kv_heads`` K/V heads (``None``: ``llm_heads``; :attr:`kv_heads`), q/k/v bias
    ``llm_qkv_bias``
    (Qwen2), rotary positions of base ``rope_theta`` (``None``: none), embedding and head
    tied when ``tie_embeddings``. Head counts, FFN widths and K/V heads must divide by the
    TP sizes used (:meth:`check_tp`).
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
    # --- block choices; the defaults are the tiny model's ---
    image_placeholders: int | None = None
    enc_act: str = "gelu"
    enc_bias: bool = False
    enc_patch_bias: bool = True
    enc_class_token: bool = False
    enc_positions: bool = False
    enc_pre_norm: bool = False
    enc_final_norm: bool = True
    enc_feature_select: str = "full"
    enc_norm_eps: float | None = None
    proj_bias: bool = False
    llm_norm: str = "layernorm"
    llm_mlp: str = "gelu"
    llm_kv_heads: int | None = None
    llm_qkv_bias: bool = False
    rope_theta: float | None = None
    tie_embeddings: bool = False
    image_channels: int = 3

    def __post_init__(self) -> None:
        # llm_kv_heads, enc_norm_eps and image_placeholders keep what was given (None:
        # derived, by the properties kv_heads, encoder_norm_eps, placeholders_per_image),
        # so dataclasses.replace(cfg, llm_heads=...) derives them again.
        for name in _FLOATS:
            if getattr(self, name) is None and name in ("rope_theta", "enc_norm_eps"):
                continue
            fix = "e.g. 1e-5 (a norm epsilon: <= 0 can divide by zero)"
            if name == "rope_theta":
                fix = "e.g. 10000.0 (the rotary base), or None for no positions"
            object.__setattr__(
                self, name, check_positive_float(f"MimoConfig.{name}", getattr(self, name), fix=fix)
            )
        for name in _BOOLS:
            check_bool(f"MimoConfig.{name}", getattr(self, name))
        for name, choices in _CHOICES.items():
            check_choice(f"MimoConfig.{name}", getattr(self, name), choices)
        skip = {*_BOOLS, *_FLOATS, *_CHOICES}
        for name, value in self.__dict__.items():
            if name not in skip and not (value is None and name in _DERIVED):
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
        if self.kv_heads < 1 or self.llm_heads % self.kv_heads:
            raise ValueError(
                f"MimoConfig.llm_kv_heads={self.kv_heads} must divide llm_heads="
                f"{self.llm_heads} (grouped-query attention); e.g. llm_kv_heads={self.llm_heads}"
            )
        if self.rope_theta is not None and (self.llm_hidden // self.llm_heads) % 2:
            raise ValueError(
                f"rotary positions need an even head dim; llm_hidden={self.llm_hidden} / "
                f"llm_heads={self.llm_heads} is odd; pick other sizes or rope_theta=None"
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"MimoConfig.image_token_id={self.image_token_id} must be a vocab id in "
                f"[0, {self.vocab_size}); the placeholder is embedded before being replaced"
            )
        self._check_image_placeholders()

    def _check_image_placeholders(self) -> None:
        derived = self.placeholders_per_image
        given = self.image_placeholders
        if given is not None and given != derived:
            raise ValueError(
                f"MimoConfig.image_placeholders={given} but the encoder emits {derived} "
                f"tokens per image (num_patches={self.num_patches}, enc_class_token="
                f"{self.enc_class_token}, enc_feature_select={self.enc_feature_select!r}); "
                f"pass {derived} or None"
            )
        if derived < 1:
            raise ValueError(
                f"MimoConfig: an image yields {derived} placeholders (num_patches="
                f"{self.num_patches}, enc_feature_select={self.enc_feature_select!r}); "
                "use more patches or enc_feature_select='full'"
            )
        if derived > self.seq_len:
            raise ValueError(
                f"MimoConfig.image_placeholders={derived} exceeds seq_len={self.seq_len}; "
                "the image tokens must fit in the sequence"
            )

    @property
    def kv_heads(self) -> int:
        """The LLM's K/V heads: ``llm_kv_heads``, or ``llm_heads`` when it is ``None``."""
        return self.llm_heads if self.llm_kv_heads is None else self.llm_kv_heads

    @property
    def encoder_norm_eps(self) -> float:
        """The encoder's LayerNorm eps: ``enc_norm_eps``, or ``norm_eps`` when ``None``."""
        return self.norm_eps if self.enc_norm_eps is None else self.enc_norm_eps

    @property
    def placeholders_per_image(self) -> int:
        """The encoder's output tokens per image, i.e. the placeholders each image takes:
        ``num_patches``, +1 with a class token, -1 with ``enc_feature_select="default"``."""
        return self.num_patches + self.enc_class_token - (self.enc_feature_select == "default")

    @property
    def patch_size(self) -> int:
        """``p`` with ``patch_dim = image_channels·p·p`` (``ValueError`` when there is none)."""
        side = round((self.patch_dim / max(self.image_channels, 1)) ** 0.5)
        if self.image_channels * side * side != self.patch_dim:
            raise ValueError(
                f"patch_dim={self.patch_dim} is not image_channels={self.image_channels} x p x p "
                "for any p; images need square patches (set image_channels)"
            )
        return side

    @property
    def encoder_positions(self) -> int:
        """Tokens each image runs through the encoder blocks (+1 for the class token)."""
        return self.num_patches + self.enc_class_token

    @property
    def fixed_image_size(self) -> bool:
        """True when every image must hold exactly ``num_patches`` tokens (learned
        positions or a class token): ragged images then run as a ``[n, P, ·]`` batch."""
        return self.enc_positions or self.enc_class_token or self.enc_feature_select != "full"

    @property
    def encoder_cost_c(self) -> float:
        """``c`` of the balance plan's image cost ``t² + c·t`` for this encoder: per token
        the linears weigh ``2·enc_hidden + enc_ffn`` against attention's ``t`` per token."""
        return 2.0 * self.enc_hidden + self.enc_ffn

    def check_cp_comm(self, cp_comm: str, *, llm_tp: int = 1, llm_cp: int = 1) -> None:
        """Raise ``ValueError`` when ``cp_comm`` is not a CP mode or, for ``"a2a"``, when a
        TP rank's q or k/v heads (``llm_heads / tp``, ``llm_kv_heads / tp``) do not divide
        by ``llm_cp`` (local; call after :meth:`check_tp`)."""
        from mp_bridge.layers.attention.cp_attention import check_comm_heads

        check_comm_heads(cp_comm, self.llm_heads // llm_tp, self.kv_heads // llm_tp, llm_cp)

    def check_tp(self, *, encoder_tp: int = 1, llm_tp: int = 1) -> None:
        """Raise ``ValueError`` naming the size when a TP size does not divide the model."""
        checks = (
            ("enc_heads", self.enc_heads, encoder_tp, "encoder tp"),
            ("enc_ffn", self.enc_ffn, encoder_tp, "encoder tp"),
            ("proj_hidden", self.proj_hidden, encoder_tp, "encoder tp"),
            ("llm_heads", self.llm_heads, llm_tp, "llm tp"),
            ("llm_kv_heads", self.kv_heads, llm_tp, "llm tp"),
            ("llm_ffn", self.llm_ffn, llm_tp, "llm tp"),
        )
        for name, value, tp, axis in checks:
            if value % tp:
                raise ValueError(
                    f"MimoConfig.{name}={value} is not divisible by {axis}={tp}; "
                    f"choose a {name} that is a multiple of {tp}"
                )
