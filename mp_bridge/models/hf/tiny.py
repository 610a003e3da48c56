"""Small random LLaVA models built by transformers itself, offline (no download): the
oracle of the HF tests and ``mp-bridge hf tiny``.

``tiny_llava(text="llama"|"qwen2"|"mistral", vision="clip"|"siglip", ...)`` returns
``LlavaForConditionalGeneration`` in fp32 with a grouped-query text model (hidden 32, 8
heads, 4 K/V heads: splits up to TP 4), 8x8 images in 4x4 patches (4 patches per
image), 3 vision layers of which ``vision_feature_layer=-2`` runs 2, and a 64-token vocab
whose last id is the image token. ``text_overrides`` / ``vision_overrides`` go to the
text and vision configs (e.g. ``num_key_value_heads=1``, ``image_size=12``).
"""

from __future__ import annotations

__all__ = ["tiny_llava"]


def tiny_llava(
    text: str = "llama",
    vision: str = "clip",
    *,
    tie: bool = False,
    seed: int = 0,
    attn_implementation: str = "eager",
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    **llava_overrides,
):
    """A random ``LlavaForConditionalGeneration`` (see the module); ``llava_overrides`` go
    to ``LlavaConfig`` (e.g. ``vision_feature_select_strategy="full"``)."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        MistralConfig,
        Qwen2Config,
        SiglipVisionConfig,
    )

    texts = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    visions = {"clip": CLIPVisionConfig, "siglip": SiglipVisionConfig}
    if text not in texts or vision not in visions:
        raise ValueError(
            f"text={text!r} / vision={vision!r}: use {sorted(texts)} / {sorted(visions)}"
        )
    text_kwargs = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=64, tie_word_embeddings=tie, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip
    if text == "mistral":
        text_kwargs["sliding_window"] = None
    text_kwargs.update(text_overrides or {})
    vision_kwargs = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        image_size=8, patch_size=4, num_channels=3,
    )  # fmt: skip
    vision_kwargs.update(vision_overrides or {})
    llava_overrides.setdefault("image_token_id", text_kwargs["vocab_size"] - 1)
    config = LlavaConfig(
        vision_config=visions[vision](**vision_kwargs), text_config=texts[text](**text_kwargs),
        tie_word_embeddings=tie, **llava_overrides,
    )  # fmt: skip
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
    # transformers initializes some tensors (biases, norms) to constants; draw them all so
    # a wrong mapping between two tensors cannot hide behind equal values.
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.float()
