"""Our reference model loaded from a transformers LLaVA equals transformers' own model.

Oracle: ``LlavaForConditionalGeneration`` built offline from small random configs
(:func:`tiny_llava`), fp32. Tolerances: loss 1e-5 relative and gradients 1e-4 absolute,
the MIMO oracle tests' (measured here: ~1e-7 both; the two compute the same math in
another order: SDPA vs eager softmax, fused vs separate q/k/v matmuls).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import LlavaForConditionalGeneration  # noqa: E402

from mp_bridge.models import ReferenceMimo  # noqa: E402
from mp_bridge.models.hf import config_from_hf, hf_batch, load_hf, pixel_patches, save_hf  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402
from tests.hf_llava import grad_errors, llava_inputs  # noqa: E402

CASES = [
    # text, vision, tied head, attention, LlavaConfig overrides, images per sample
    ("llama", "clip", False, "eager", {}, (1, 2, 0)),
    ("qwen2", "siglip", True, "sdpa", {}, (1, 1, 1)),
    ("mistral", "clip", True, "sdpa", {"vision_feature_select_strategy": "full"}, (2, 1, 0)),
    ("llama", "siglip", False, "eager", {"vision_feature_layer": 1}, (1, 1, 1)),
]


# Shapes and options the tiny default does not take: text / vision / LlavaConfig overrides.
VARIANTS = {
    "multi-query (1 K/V head)": ("llama", "clip", {"num_key_value_heads": 1}, {}, {}),
    "K/V heads == heads, qkv bias": ("qwen2", "siglip", {"num_key_value_heads": 8}, {}, {}),
    "vocab 97, hidden 48 in 6 heads": (
        "llama", "clip",
        {"vocab_size": 97, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2},
        {}, {},
    ),
    "9 patches, 2 vision heads, gelu": (
        "mistral", "siglip", {},
        {"image_size": 12, "num_attention_heads": 2, "hidden_act": "gelu"}, {},
    ),
    "8x8 patches, no projector bias": (
        "llama", "clip", {}, {"image_size": 16, "patch_size": 8},
        {"multimodal_projector_bias": False, "vision_feature_layer": 3},
    ),
    "rope_theta 1e6, rms eps 1e-3": (
        "qwen2", "clip",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-3},
        {}, {"vision_feature_select_strategy": "full"},
    ),
}  # fmt: skip


def _saved(tmp_path, text="llama", vision="clip", tie=False, attn="eager", **overrides):
    hf = tiny_llava(text, vision, tie=tie, attn_implementation=attn, **overrides)
    path = str(tmp_path / "hf")
    hf.save_pretrained(path)
    return hf, path


def _loaded(path, seq_len=16):
    cfg = config_from_hf(path, seq_len=seq_len)
    model = ReferenceMimo(cfg)
    load_hf(path, model)
    return cfg, model


def _assert_loss_and_gradients_match(hf, path, images, seq=16):
    cfg, ours = _loaded(path, seq_len=seq)
    ids, pixels, mask, labels = llava_inputs(cfg, images, seq=seq)
    want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
    want.backward()
    batch = hf_batch(cfg, ids, pixels, labels, mask)
    got = ours(batch.input_ids, batch.labels, batch.loss_mask, batch.images)
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    errors = grad_errors(ours, hf, cfg)
    assert len(errors) > 30 and max(errors.values()) <= 1e-4, max(
        errors.items(), key=lambda e: e[1]
    )


@pytest.mark.parametrize("text,vision,tie,attn,overrides,images", CASES)
def test_loss_and_every_gradient_match_transformers(
    tmp_path, text, vision, tie, attn, overrides, images
):
    hf, path = _saved(tmp_path, text, vision, tie, attn, **overrides)
    _assert_loss_and_gradients_match(hf, path, images)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    text, vision, text_overrides, vision_overrides, llava_overrides = VARIANTS[variant]
    hf, path = _saved(
        tmp_path, text, vision, attn="sdpa", text_overrides=text_overrides,
        vision_overrides=vision_overrides, **llava_overrides,
    )  # fmt: skip
    _assert_loss_and_gradients_match(hf, path, (2, 0, 1), seq=24)


def test_packed_documents_restart_rotary_positions_as_separate_hf_rows(tmp_path):
    """Two right-padded HF rows == one packed row of their real tokens (cu_seqlens)."""
    hf, path = _saved(tmp_path, "qwen2", "clip")
    cfg, ours = _loaded(path, seq_len=32)
    ids, pixels, mask, labels = llava_inputs(cfg, (1, 1), pad=(0, 5))
    want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask, labels=labels).loss
    batch = hf_batch(cfg, ids, pixels, labels, mask)
    keep = mask.bool().flatten()
    cu = torch.tensor([0, 16, 27])
    got = ours(batch.input_ids.flatten()[keep], batch.labels.flatten()[keep],
               batch.loss_mask.flatten()[keep], batch.images, cu_seqlens=cu)  # fmt: skip
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())


@pytest.mark.parametrize("text,vision,tie", [("llama", "clip", False), ("qwen2", "siglip", True)])
def test_save_after_load_gives_back_the_hf_tensors_bitwise(tmp_path, text, vision, tie):
    hf, path = _saved(tmp_path, text, vision, tie)
    _, ours = _loaded(path)
    out = str(tmp_path / "out")
    save_hf(out, ours)
    before = load_file(os.path.join(path, "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(before) == sorted(after)  # untrained layers, post_layernorm, head.* kept
    assert all(
        torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before
    )
    back = LlavaForConditionalGeneration.from_pretrained(out)
    want, got = hf.state_dict(), back.state_dict()
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]  # published by rename


def test_a_sharded_checkpoint_with_its_index_loads_the_same(tmp_path):
    hf, path = _saved(tmp_path)
    sharded = str(tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    _, one = _loaded(path)
    _, many = _loaded(sharded)
    for (name, a), (_, b) in zip(one.named_parameters(), many.named_parameters()):
        assert torch.equal(a, b), name


def test_pixel_patches_times_the_flattened_conv_weight_is_the_conv(tmp_path):
    cfg, _ = _loaded(_saved(tmp_path)[1])
    pixels, weight = torch.randn(2, 3, 8, 8), torch.randn(16, 3, 4, 4)
    conv = torch.nn.functional.conv2d(pixels, weight, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(pixel_patches(cfg, pixels) @ weight.reshape(16, -1).T, conv)


def test_cli_hf_tiny_writes_a_model_transformers_loads(tmp_path, capsys):
    from mp_bridge.cli import main

    path = str(tmp_path / "tiny")
    assert main(["hf", "tiny", path, "--text", "qwen2", "--vision", "siglip", "--tie"]) == 0
    model = LlavaForConditionalGeneration.from_pretrained(path)
    assert model.config.text_config.model_type == "qwen2" and model.config.tie_word_embeddings
    cfg = config_from_hf(path, seq_len=16)
    assert cfg.llm_qkv_bias and cfg.tie_embeddings and not cfg.enc_class_token
    assert "wrote qwen2 + siglip LLaVA" in capsys.readouterr().out


def test_a_vocab_shard_gets_its_rows_and_zero_padding_rows(tmp_path):
    # One process, a vocab-parallel shard padded past the vocab (64 real rows of 66), its
    # padding rows filled with NaN first: load_hf's fill writes the HF rows and zeros.
    from mp_bridge.layers import mark_sharded
    from mp_bridge.models.hf import hf_mappings
    from mp_bridge.models.hf.hf_load import _fill
    from mp_bridge.models.hf.safetensors_files import HFFiles

    hf, path = _saved(tmp_path)
    cfg = config_from_hf(path, seq_len=16)
    m = next(m for m in hf_mappings(cfg) if m.ours == "llm.embed.weight")
    param = torch.full((cfg.vocab_size + 2, cfg.llm_hidden), float("nan"))
    mark_sharded(param, dim=0, group=None, full_size=cfg.vocab_size)
    _fill(HFFiles(path), m, param)
    want = hf.state_dict()["model.language_model.embed_tokens.weight"]
    assert torch.equal(param[: cfg.vocab_size], want)
    assert torch.equal(param[cfg.vocab_size :], torch.zeros(2, cfg.llm_hidden))


def test_a_bf16_model_trained_in_fp32_comes_back_from_pretrained_in_fp32(tmp_path):
    """Loaded from bf16 weights into fp32 parameters and moved off the bf16 grid (a
    training step's worth): ``config.json`` names float32, so ``from_pretrained`` (dtype
    "auto") builds fp32 and gets every trained tensor bitwise; untrained tensors stay
    bf16 in the file and are widened exactly."""
    from mp_bridge.models.hf import disk_to_module, hf_mappings
    from mp_bridge.models.hf.hf_save import hf_tensors

    hf = tiny_llava("qwen2", "clip").to(torch.bfloat16)
    path = str(tmp_path / "bf16")
    hf.save_pretrained(path)
    cfg, ours = _loaded(path)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 1e-4)  # not representable in bf16
    out = str(tmp_path / "out")
    save_hf(out, ours)
    back = LlavaForConditionalGeneration.from_pretrained(out)
    state, params = back.state_dict(), dict(ours.named_parameters())
    assert all(t.dtype == torch.float32 for t in state.values())
    for m in hf_mappings(cfg):
        for key, want in zip(m.hf, hf_tensors(m, params[m.ours].detach())):
            assert torch.equal(state[disk_to_module(key)], want), key
    untrained = load_file(os.path.join(path, "model.safetensors"))
    assert len(ours.hf_untrained) > 5  # feature layer -2: the last layer, post_layernorm
    for key in ours.hf_untrained:
        assert torch.equal(state[disk_to_module(key)], untrained[key].float()), key
