"""``mp-bridge demo --hf DIR`` end to end: a transformers LLaVA written by ``mp-bridge hf
tiny`` trained on 4 ranks it launches itself (encoder TP2/DP2 -> LLM TP2/CP2, ragged
right-padded batches), checked against transformers' own model trained in one process.
The tolerances are the MIMO oracle tests' (:mod:`mp_bridge.models.hf.hf_parity`)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from mp_bridge.cli import main  # noqa: E402


def test_demo_hf_trains_a_transformers_llava_and_matches_transformers(capfd, tmp_path):
    path = str(tmp_path / "llava")
    assert main(["hf", "tiny", path, "--text", "qwen2", "--vision", "clip"]) == 0
    argv = ["demo", "--hf", path, "--world", "4", "--encoder", "tp=2,dp=2"]
    assert main([*argv, "--llm", "tp=2,cp=2", "--steps", "3"]) == 0
    out = capfd.readouterr().out
    assert "encoder tp=2,dp=2 -> llm tp=2,cp=2, routed flow, ragged HF batches" in out
    step = r"^step +\d+/3  loss \d+\.\d+  tokens/s +\d+  step +\d+\.\d ms$"
    assert len(re.findall(step, out, re.M)) == 3
    for row in ("loss \\(3 steps\\)", "param grads \\(step 1, 68 HF tensors\\)",
                "pixel_values grad \\(step 1\\)", "weights \\(gathered\\)",
                "k_proj.bias weights"):  # fmt: skip
        assert re.search(rf"^{row} .* yes$", out, re.M), out
    assert "parity OK" in out
