"""What ``mp_bridge.models.hf`` refuses, each with a message naming the option, the key or
the shape (configs, directories, batches)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from mp_bridge.models import ReferenceMimo  # noqa: E402
from mp_bridge.models.hf import config_from_hf, hf_batch, load_hf, save_hf  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402
from tests.hf_llava import llava_inputs  # noqa: E402


def _config(text="llama", vision="clip", **overrides):
    return tiny_llava(text, vision, **overrides).config


def _set(config, where, **values):
    target = getattr(config, where) if where else config
    for k, v in values.items():
        setattr(target, k, v)
    return config


@pytest.mark.parametrize(
    "text,where,values,match",
    [
        ("llama", "text_config", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                      "factor": 2.0}}, "rope_type='linear'"),
        ("mistral", "text_config", {"sliding_window": 8}, "sliding_window=8"),
        ("qwen2", "text_config", {"use_sliding_window": True}, "use_sliding_window=True"),
        ("llama", "text_config", {"attention_bias": True}, "attention_bias=True"),
        ("mistral", "text_config", {"mlp_bias": True}, "mlp_bias=True"),
        ("llama", "text_config", {"head_dim": 8}, "head_dim=8"),
        ("llama", "text_config", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", "text_config", {"model_type": "gemma"}, "model_type='gemma'"),
        ("llama", "vision_config", {"model_type": "dinov2"}, "model_type='dinov2'"),
        ("llama", None, {"vision_feature_layer": [-2, -1]}, r"vision_feature_layer=\[-2, -1\]"),
        ("llama", None, {"vision_feature_layer": 7}, "vision_feature_layer=7"),
        ("llama", None, {"projector_hidden_act": "relu"}, "projector_hidden_act='relu'"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(text, where, values, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(_set(_config(text), where, **values))


def test_a_config_that_is_not_llava_is_refused():
    with pytest.raises(ValueError, match="model_type='llama' is not supported"):
        config_from_hf(_config().text_config)


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "hf")
    tiny_llava().save_pretrained(path)
    return path


def test_bad_directories_are_refused(tmp_path, saved):
    with pytest.raises(ValueError, match="does not exist"):
        config_from_hf(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no config.json"):
        config_from_hf(str(empty))
    os.remove(os.path.join(saved, "model.safetensors"))
    model = ReferenceMimo(config_from_hf(saved, seq_len=16))
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        load_hf(saved, model)


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.pop("language_model.model.layers.1.mlp.up_proj.weight"),
         r"missing language_model.model.layers.1.mlp.up_proj.weight \(expected shape \(48, 32\)\)"),
        (lambda t: t.update({"vision_tower.embeddings.position_ids": torch.zeros(5)}),
         r"holds vision_tower.embeddings.position_ids \(shape \(5,\)\) that no parameter"),
        (lambda t: t.update({"multi_modal_projector.linear_1.bias": torch.zeros(33)}),
         r"multi_modal_projector.linear_1.bias has shape \(33,\) but the config gives \(32,\)"),
    ],
)  # fmt: skip
def test_missing_unexpected_and_misshaped_keys_change_no_parameter(saved, edit, match):
    _edit_tensors(saved, edit)
    model = ReferenceMimo(config_from_hf(saved, seq_len=16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_hf(saved, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_tied_head_needs_no_lm_head_key(tmp_path):
    path = str(tmp_path / "tied")
    tiny_llava("qwen2", "siglip", tie=True).save_pretrained(path)
    assert "language_model.lm_head.weight" not in load_file(os.path.join(path, "model.safetensors"))
    load_hf(path, ReferenceMimo(config_from_hf(path, seq_len=16)))  # no error


def test_a_model_of_another_config_is_refused(saved):
    cfg = config_from_hf(saved, seq_len=16)
    other = ReferenceMimo(type(cfg)(**{**cfg.__dict__, "llm_layers": 1}))
    with pytest.raises(ValueError, match="llm_layers: model 1 vs"):
        load_hf(saved, other)


def test_save_hf_needs_the_hf_config_and_refuses_to_replace_a_non_model(tmp_path, saved):
    cfg = config_from_hf(saved, seq_len=16)
    with pytest.raises(ValueError, match="save_hf needs the HF config"):
        save_hf(str(tmp_path / "out"), ReferenceMimo(cfg))
    model = ReferenceMimo(cfg)
    load_hf(saved, model)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    with pytest.raises(ValueError, match="will not replace"):
        save_hf(str(tmp_path / "notes"), model)
    assert json.load(open(os.path.join(saved, "config.json")))["model_type"] == "llava"


def test_hf_batch_refuses_left_padding_labels_on_padding_and_wrong_placeholder_counts(saved):
    cfg = config_from_hf(saved, seq_len=16)
    ids, pixels, mask, labels = llava_inputs(cfg, (1, 1, 1))
    left = mask.clone()
    left[0, :2] = 0
    with pytest.raises(ValueError, match="right padding only"):
        hf_batch(cfg, ids, pixels, labels, left)
    padded = mask.clone()
    padded[1, -2:] = 0
    with pytest.raises(ValueError, match="labels must be -100 at padding"):
        hf_batch(cfg, ids, pixels, labels, padded)
    with pytest.raises(ValueError, match=r"each of the 2 images takes image_placeholders=4"):
        hf_batch(cfg, ids, pixels[:2], labels, mask)
    with pytest.raises(ValueError, match="must give num_patches=4 patches"):
        hf_batch(cfg, ids, torch.randn(3, 3, 12, 12), labels, mask)


def test_hf_batch_labels_default_and_shift(saved):
    cfg = config_from_hf(saved, seq_len=16)
    ids, pixels, mask, labels = llava_inputs(cfg, (1, 1, 1))
    batch = hf_batch(cfg, ids, pixels, attention_mask=mask)
    assert torch.equal(batch.labels[:, :-1], labels[:, 1:])  # labels=None: ids, -100 at images/pad
    assert (batch.labels[:, -1] == -100).all()
    assert torch.equal(batch.loss_mask, (batch.labels != -100).float())
    assert batch.images.shape == (3, 4, 48)  # one image per sample: uniform


def test_kv_heads_that_do_not_split_over_tp_are_named():
    cfg = config_from_hf(tiny_llava().config, seq_len=16)
    with pytest.raises(ValueError, match="llm_kv_heads=4 is not divisible by llm tp=8"):
        cfg.check_tp(llm_tp=8)
