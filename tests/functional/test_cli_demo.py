"""``mp-bridge demo`` end to end: it launches its own 8-rank world (no DistributedWorld).

The demo forks its ranks from this process, so a patch applied here is inherited by
every rank: that is how the second test breaks the model and checks the exit code.

Device: the demo picks its own (gloo on the CPU here, NCCL with one GPU per rank where
CUDA has enough devices); it does not read ``current_device()``, so these tests do not
depend on the test device.
"""

from __future__ import annotations

import re

import pytest

import mp_bridge.models.colocated.parts as parts_module
from mp_bridge.cli import main


def test_demo_trains_and_reports_parity(capfd, tmp_path):
    plot = tmp_path / "loss.png"
    assert main(["demo", "--steps", "3", "--plot", str(plot)]) == 0
    out = capfd.readouterr().out
    assert "ragged (0..3 images of 1..4 tokens per sample) batches" in out  # the default
    assert "batches, routed flow" in out  # the default flow
    step = r"^step +\d+/3  loss \d+\.\d+  tokens/s +\d+  step +\d+\.\d ms$"
    assert len(re.findall(step, out, re.M)) == 3
    assert re.search(r"^loss \(3 steps\) .* yes$", out, re.M), out
    assert re.search(r"^weights \(gathered\) .* yes$", out, re.M), out
    assert "parity OK" in out
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_exits_1_when_parity_fails(capfd, monkeypatch):
    original = parts_module.masked_mean
    # Each rank normalizes by its own token count: the global loss is wrong.
    monkeypatch.setattr(
        parts_module, "masked_mean", lambda values, mask, *, group=None: original(values, mask)
    )
    assert main(["demo", "--steps", "2"]) == 1
    out = capfd.readouterr().out
    assert re.search(r"^loss \(2 steps\) .* NO$", out, re.M), out
    assert "parity FAILED" in out


def test_demo_uniform_batches_on_request(capfd):
    assert main(["demo", "--steps", "2", "--uniform"]) == 0
    out = capfd.readouterr().out
    assert "uniform (4 image tokens per sample) batches" in out
    assert re.search(r"^weights \(gathered\) .* yes$", out, re.M), out
    assert "parity OK" in out


def test_demo_gather_flow_on_request(capfd):
    assert main(["demo", "--steps", "2", "--flow", "gather"]) == 0
    out = capfd.readouterr().out
    assert "batches, gather flow" in out
    assert re.search(r"^param grads \(step 1\) .* yes$", out, re.M), out
    assert "parity OK" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--llm", "tp=2,pp=2,dp=2", "--microbatches", "4"],
        ["--encoder", "tp=1,dp=8", "--llm", "cp=2,pp=2,dp=2", "--microbatches", "2",
         "--flow", "gather"],
    ],
    ids=["tp2pp2dp2-M4-routed", "cp2pp2dp2-M2-gather"],
)  # fmt: skip
def test_demo_with_a_pipelined_llm(capfd, argv):
    assert main(["demo", "--steps", "2", *argv]) == 0
    out = capfd.readouterr().out
    assert re.search(r"parity vs single-process oracle \(.*pp=2,dp=2,M=\d", out), out
    assert re.search(r"^weights \(gathered\) .* yes$", out, re.M), out
    assert "parity OK" in out


def test_demo_balanced_long_tail_prints_encoder_times_before_and_after(capfd):
    assert main(["demo", "--steps", "2", "--balance", "--images", "long-tail"]) == 0
    out = capfd.readouterr().out
    assert "long-tail (heavy-tailed images per sample" in out and "balanced encoders" in out
    assert re.search(r"^encoder input grad .* yes$", out, re.M), out
    table = re.findall(r"^(\d)\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, re.M)
    assert [int(r) for r, _, _ in table] == list(range(8)), out  # one row per rank
    assert re.search(r"measured max/mean \d+\.\d+ -> \d+\.\d+", out), out
    assert "parity OK" in out


def test_demo_uniform_and_long_tail_exclude_each_other(capfd):
    assert main(["demo", "--uniform", "--images", "long-tail"]) == 2
    assert "--uniform and --images long-tail exclude each other" in capfd.readouterr().err
