"""``config_from_hf``: a transformers ``LlavaConfig`` as a :class:`MimoConfig`.

Supported: ``llava`` with CLIP (``clip_vision_model``) or SigLIP (``siglip_vision_model``)
vision and Llama, Qwen2 or Mistral text, as transformers 5.x spells the configs. Every
option our blocks do not compute is refused by a ``ValueError`` naming it: a ``rope_type``
other than ``"default"``, an active sliding window (Mistral ``sliding_window``, Qwen2
``use_sliding_window``), ``attention_bias`` / ``mlp_bias`` on Llama / Mistral, a
``head_dim`` other than ``hidden / heads``, a list of vision feature layers, other
activations, and any other architecture. ``transformers`` is imported here only.
"""

from __future__ import annotations

import os

from mp_bridge.models.data.config import ENCODER_ACTIVATIONS, MimoConfig

__all__ = ["VISION_TYPES", "TEXT_TYPES", "config_from_hf", "llava_config"]

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")
TEXT_TYPES = ("llama", "qwen2", "mistral")


def llava_config(path_or_config: object):
    """A ``LlavaConfig`` from a directory / ``config.json`` path, a config object or its
    ``to_dict()`` (what a checkpoint records)."""
    from transformers import AutoConfig, LlavaConfig, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        config = path_or_config
    elif isinstance(path_or_config, dict):
        kind = path_or_config.get("model_type")
        if kind != "llava":
            raise ValueError(
                f"model_type={kind!r} is not supported; config_from_hf reads LLaVA "
                "(model_type 'llava') configs only"
            )
        config = LlavaConfig.from_dict(path_or_config)
    elif isinstance(path_or_config, (str, os.PathLike)):
        path = os.fspath(path_or_config)
        if not os.path.exists(path):
            raise ValueError(
                f"config_from_hf: {path!r} does not exist; pass a save_pretrained "
                "directory, its config.json or a LlavaConfig"
            )
        directory = os.path.dirname(path) if os.path.isfile(path) else path
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise ValueError(
                f"config_from_hf: {path!r} holds no config.json; pass a save_pretrained directory"
            )
        config = AutoConfig.from_pretrained(directory)
    else:
        raise TypeError(
            "config_from_hf takes a directory, a config.json path, a transformers config or "
            "its to_dict(), "
            f"got {type(path_or_config).__name__}"
        )
    if getattr(config, "model_type", None) != "llava":
        raise ValueError(
            f"model_type={getattr(config, 'model_type', None)!r} is not supported; "
            "config_from_hf reads LLaVA (model_type 'llava') configs only"
        )
    return config


def _refuse(name: str, value: object, why: str) -> None:
    raise ValueError(f"{name}={value!r} is not supported: {why}")


def _text_fields(t) -> dict:
    kind = t.model_type
    if kind not in TEXT_TYPES:
        _refuse("text_config.model_type", kind, f"the text model must be one of {TEXT_TYPES}")
    rope = dict(getattr(t, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        _refuse(
            "text_config.rope_parameters.rope_type",
            rope.get("rope_type"),
            "only 'default' rotary positions are computed",
        )
    if kind == "mistral" and getattr(t, "sliding_window", None) is not None:
        _refuse(
            "text_config.sliding_window",
            t.sliding_window,
            "sliding-window attention is not computed; set it to None",
        )
    if kind == "qwen2" and getattr(t, "use_sliding_window", False):
        _refuse("text_config.use_sliding_window", True, "sliding-window attention is not computed")
    if kind in ("llama", "mistral"):
        for name in ("attention_bias", "mlp_bias"):
            if getattr(t, name, False):
                _refuse(f"text_config.{name}", True, f"{kind} blocks here have no such bias")
    head_dim = getattr(t, "head_dim", None)
    if head_dim is not None and head_dim * t.num_attention_heads != t.hidden_size:
        _refuse(
            "text_config.head_dim",
            head_dim,
            f"it must be hidden_size / num_attention_heads = "
            f"{t.hidden_size} / {t.num_attention_heads}",
        )
    if t.hidden_act != "silu":
        _refuse("text_config.hidden_act", t.hidden_act, "the SwiGLU gate is 'silu'")
    return dict(
        llm_hidden=t.hidden_size,
        llm_heads=t.num_attention_heads,
        llm_kv_heads=t.num_key_value_heads or t.num_attention_heads,
        llm_ffn=t.intermediate_size,
        llm_layers=t.num_hidden_layers,
        vocab_size=t.vocab_size,
        norm_eps=t.rms_norm_eps,
        llm_norm="rmsnorm",
        llm_mlp="swiglu",
        llm_qkv_bias=kind == "qwen2",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def _vision_fields(v, feature_layer: object, strategy: str) -> dict:
    kind = v.model_type
    if kind not in VISION_TYPES:
        _refuse("vision_config.model_type", kind, f"the vision tower must be one of {VISION_TYPES}")
    if not isinstance(feature_layer, int) or isinstance(feature_layer, bool):
        _refuse(
            "vision_feature_layer",
            feature_layer,
            "a list of feature layers is not computed; give one int",
        )
    n = v.num_hidden_layers
    run = feature_layer if feature_layer >= 0 else n + 1 + feature_layer
    if not 0 <= run <= n:
        _refuse("vision_feature_layer", feature_layer, f"the tower has {n} layers")
    if strategy not in ("default", "full"):
        _refuse("vision_feature_select_strategy", strategy, "use 'default' or 'full'")
    if v.hidden_act not in ENCODER_ACTIVATIONS:
        _refuse("vision_config.hidden_act", v.hidden_act, f"use one of {ENCODER_ACTIVATIONS}")
    if v.image_size % v.patch_size:
        _refuse(
            "vision_config.image_size",
            v.image_size,
            f"it must be a multiple of patch_size={v.patch_size}",
        )
    clip = kind == "clip_vision_model"
    return dict(
        patch_dim=v.num_channels * v.patch_size**2,
        image_channels=v.num_channels,
        num_patches=(v.image_size // v.patch_size) ** 2,
        enc_hidden=v.hidden_size,
        enc_heads=v.num_attention_heads,
        enc_ffn=v.intermediate_size,
        enc_layers=run,
        enc_act=v.hidden_act,
        enc_bias=True,
        enc_patch_bias=not clip,
        enc_class_token=clip,
        enc_positions=True,
        enc_pre_norm=clip,
        enc_final_norm=False,
        enc_feature_select=strategy,
        enc_norm_eps=v.layer_norm_eps,
    )


def config_from_hf(path_or_config: object, *, seq_len: int | None = None) -> MimoConfig:
    """The :class:`MimoConfig` of a LLaVA checkpoint (directory, ``config.json``, a
    ``LlavaConfig`` or its ``to_dict()``); ``seq_len`` (default: the text model's
    ``max_position_embeddings``) is the sequence length our synthetic batches use.
    Placeholders per image come from the vision config (``(image_size / patch_size)²``,
    +1 for CLIP's class token, −1 for ``"default"``), never from ``image_seq_length``."""
    config = llava_config(path_or_config)
    if config.projector_hidden_act != "gelu":
        _refuse("projector_hidden_act", config.projector_hidden_act, "the projector uses 'gelu'")
    text = _text_fields(config.text_config)
    vision = _vision_fields(
        config.vision_config, config.vision_feature_layer, config.vision_feature_select_strategy
    )
    return MimoConfig(
        **vision,
        **text,
        proj_hidden=text["llm_hidden"],
        proj_bias=bool(getattr(config, "multimodal_projector_bias", True)),
        image_token_id=config.image_token_id,
        tie_embeddings=bool(config.tie_word_embeddings),
        seq_len=seq_len or config.text_config.max_position_embeddings,
    )
