"""The checkpoint wing speaks HF, in one process: ``mp-bridge hf import`` then
``mp-bridge checkpoint export-hf`` gives back transformers' tensors bitwise; a load
restores the HF config and untrained tensors (``save_hf`` after ``load``); a checkpoint
without HF data keeps its format; bad checkpoints, directories and configs are refused
by message. The 8-rank round trip across layouts: tests/functional/test_hf_checkpoint.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402

from mp_bridge import checkpoint  # noqa: E402
from mp_bridge.cli import main  # noqa: E402
from mp_bridge.models import ReferenceMimo  # noqa: E402
from mp_bridge.models.hf import config_from_hf, export_hf, import_hf, save_hf  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402
from tests.hf_llava import assert_same_hf_dirs  # noqa: E402

CASES = {
    "clip_llama_untied": ("llama", "clip", False, torch.float32),
    "siglip_qwen2_tied": ("qwen2", "siglip", True, torch.float32),
    "clip_mistral_bf16": ("mistral", "clip", False, torch.bfloat16),
}


def _hf_dir(tmp_path, text="llama", vision="clip", tie=False, dtype=torch.float32, **kw):
    path = str(tmp_path / "hf")
    tiny_llava(text, vision, tie=tie, **kw).to(dtype).save_pretrained(path)
    return path


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_cli_import_then_export_gives_back_every_hf_tensor_bitwise(tmp_path, capsys, case):
    text, vision, tie, dtype = case
    path, ckpt, out = _hf_dir(tmp_path, text, vision, tie, dtype), tmp_path / "ck", tmp_path / "o"
    assert main(["hf", "import", path, str(ckpt)]) == 0
    assert main(["checkpoint", "inspect", str(ckpt)]) == 0
    assert f"hf: llava ({text} + {vision}_vision_model)" in capsys.readouterr().out
    assert main(["checkpoint", "export-hf", str(ckpt), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert assert_same_hf_dirs(path, str(out)) > 0
    want, got = (AutoConfig.from_pretrained(p).to_dict() for p in (path, str(out)))
    assert {**got, "_name_or_path": ""} == {**want, "_name_or_path": ""}
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]  # published by rename


def test_a_load_restores_the_hf_config_and_untrained_tensors(tmp_path):
    path = _hf_dir(tmp_path, "llama", "siglip")
    imported = import_hf(path, tmp_path / "ck")
    info, metadata = checkpoint.read_checkpoint(str(tmp_path / "ck"))
    as_json = json.loads(json.dumps(imported.hf_config))  # id2label's int keys: str
    assert info.hf_config == as_json and info.hf_config["model_type"] == "llava"
    untrained = [k for k in metadata.state_dict_metadata if k.startswith("hf_untrained.")]
    assert sorted(untrained) == sorted(f"hf_untrained.{k}" for k in imported.hf_untrained)
    assert any(".head." in k for k in untrained)  # SigLIP's head: kept, never trained
    torch.manual_seed(7)
    model = ReferenceMimo(config_from_hf(path, seq_len=16))
    checkpoint.load(str(tmp_path / "ck"), model)
    want = dict(imported.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert model.hf_config == as_json
    assert sorted(model.hf_untrained) == sorted(imported.hf_untrained)
    assert all(torch.equal(t, imported.hf_untrained[k]) for k, t in model.hf_untrained.items())
    save_hf(str(tmp_path / "again"), model)
    assert_same_hf_dirs(path, str(tmp_path / "again"))


def test_a_checkpoint_without_hf_data_keeps_its_format(tmp_path):
    model = ReferenceMimo(config_from_hf(_hf_dir(tmp_path), seq_len=16))  # no load_hf
    checkpoint.save(str(tmp_path / "ck"), model)
    with open(tmp_path / "ck" / "mp_bridge.json") as f:
        raw = json.load(f)
    assert "hf_config" not in raw
    keys = checkpoint.read_checkpoint(str(tmp_path / "ck"))[1].state_dict_metadata
    assert not [k for k in keys if k.startswith("hf_untrained.")]
    with pytest.raises(ValueError, match="records no HF config: it was not saved from a model"):
        export_hf(tmp_path / "ck", tmp_path / "out")


def test_cli_refuses_bad_paths_in_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["checkpoint", "export-hf", missing, str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint at {missing!r}: the directory does not exist" in err
    assert err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert main(["hf", "import", str(tmp_path / "empty"), str(tmp_path / "ck")]) == 2
    assert "holds no config.json; pass a save_pretrained directory" in capsys.readouterr().err
    assert main(["hf", "import", missing, str(tmp_path / "ck")]) == 2
    assert f"{missing!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_import_refuses_an_unsupported_config_and_a_directory_without_weights(tmp_path):
    hf = tiny_llava("llama", "clip")
    hf.config.text_config.hidden_act = "gelu"
    hf.config.save_pretrained(tmp_path / "gelu")
    with pytest.raises(ValueError, match="text_config.hidden_act='gelu' is not supported"):
        import_hf(tmp_path / "gelu", tmp_path / "ck")
    tiny_llava("llama", "clip").config.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        import_hf(tmp_path / "bare", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_export_refuses_a_checkpoint_of_another_model_and_a_non_hf_target(tmp_path):
    imported = import_hf(_hf_dir(tmp_path), tmp_path / "ck")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    with pytest.raises(ValueError, match="export_hf will not replace .*without config.json"):
        export_hf(tmp_path / "ck", tmp_path / "notes")
    imported.hf_config = tiny_llava("qwen2", "clip").config.to_dict()  # qkv biases: not ours
    checkpoint.save(str(tmp_path / "other"), imported)
    with pytest.raises(
        ValueError, match=r"does not fit its HF config: model\.llm\..*saved nothing"
    ):
        export_hf(tmp_path / "other", tmp_path / "out")
    assert not (tmp_path / "out").exists()
