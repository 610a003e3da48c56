"""``mp-bridge demo --save`` then ``--resume`` at another layout: the curve continues.

The first run (4 ranks: encoder tp=2,dp=2 -> LLM tp=2,cp=2) saves steps 2 and 3; the
second resumes at encoder tp=4 -> LLM tp=2,dp=2 and runs steps 4 and 5. Oracle: the
single-process ``ReferenceMimo`` trained here for the whole 5 steps on the demo's data
(``demo_config()``, the 4 seeded ragged batches cycled, Adam lr 1e-2, seed 0), with no stop.
Tolerance: 5e-5 absolute on losses of ~4: the demo prints 6 decimals (5e-7) and its own
parity bound is 1e-5 relative (4e-5 here); a resume that lost the optimizer state or the
weights moves the next loss by ~1e-2 (Adam's first-step size).
"""

from __future__ import annotations

import re

import pytest
import torch

from mp_bridge.checkpoint import save
from mp_bridge.cli import main
from mp_bridge.commands.demo import IMAGES_PER_SAMPLE, POOL, demo_config
from mp_bridge.models import ReferenceMimo, synthetic_batch

LOSS_ATOL = 5e-5
STEP = re.compile(r"^step +(\d+)/\d+  loss (\d+\.\d+)", re.M)


def oracle_losses(steps: int) -> list[float]:
    """The demo's whole run in one process, never stopped."""
    cfg = demo_config()
    batches = [
        synthetic_batch(cfg, 8, seed=100 + i, images_per_sample=IMAGES_PER_SAMPLE)
        for i in range(POOL)
    ]
    torch.manual_seed(0)
    model = ReferenceMimo(cfg)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        batch = batches[step % POOL]
        optim.zero_grad(set_to_none=True)
        loss = model(*batch.text, batch.images, cu_seqlens=batch.cu_seqlens)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def test_resume_at_another_layout_continues_the_oracle_curve(tmp_path, capfd):
    root = tmp_path / "ckpt"
    argv = ["demo", "--world", "4", "--steps", "3", "--save", str(root), "--save-every", "2"]
    assert main(argv) == 0
    first = capfd.readouterr().out
    assert "saved step 2:" in first and "saved step 3:" in first
    assert (root / "latest").read_text() == "step-000003\n"
    # A run that died after publishing step 3 but before moving the pointer, and a save
    # that died midway (a step directory with no checkpoint in it): step 3 is the latest.
    (root / "latest").write_text("step-000002\n")
    (root / "step-000009").mkdir()
    resumed = ["demo", "--world", "4", "--steps", "5", "--resume", str(root)]
    assert main([*resumed, "--encoder", "tp=4", "--llm", "tp=2,dp=2"]) == 0
    out = capfd.readouterr().out
    assert "continuing from step 3" in out
    got = {int(n): float(v) for n, v in STEP.findall(first + out)}
    assert sorted(got) == [1, 2, 3, 4, 5]  # steps 4 and 5 ran only after the resume
    want = oracle_losses(5)
    for step, loss in got.items():
        assert abs(loss - want[step - 1]) <= LOSS_ATOL, (step, loss, want[step - 1])
    assert re.search(r"^loss \(5 steps\) .* yes$", out, re.M), out
    assert re.search(r"^param grads \(step 4\) .* yes$", out, re.M), out
    assert "parity OK" in out


@pytest.fixture
def saved_at_step_3(tmp_path):
    """A checkpoint as the demo's first run leaves it (one process: no ranks needed)."""
    options = {
        "images": "ragged", "uniform": False, "flow": "routed", "balance": False, "seed": 0,
        "batch_size": 8, "lr": 1e-2,
    }  # fmt: skip
    extra = {"losses": [4.0] * 3, "options": options, "config": {}}
    save(str(tmp_path / "step-000003"), torch.nn.Linear(2, 2), step=3, extra=extra)
    return tmp_path


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--uniform"], r"was trained with --uniform False but this run has True"),
        (["--seed", "1"], r"was trained with --seed 0 but this run has 1; .* --seed 0"),
        (["--flow", "gather"], r"--flow 'routed' but this run has 'gather'"),
        (["--batch-size", "16"], r"--batch-size 8 but this run has 16"),
        (["--steps", "3"], r"--steps 3 counts the whole run, .* already did 3 steps"),
    ],
)
def test_resume_refuses_other_data_options(saved_at_step_3, capfd, flags, match):
    argv = ["demo", "--world", "4", "--steps", "5", "--resume", str(saved_at_step_3), *flags]
    assert main(argv) == 2  # before any rank starts
    assert re.search(match, capfd.readouterr().err)


def test_resume_names_a_directory_without_checkpoints(tmp_path, capfd):
    assert main(["demo", "--resume", str(tmp_path)]) == 2
    assert f"--resume {tmp_path}: no complete checkpoint there" in capfd.readouterr().err


def test_save_every_needs_a_directory(capfd):
    assert main(["demo", "--save-every", "2"]) == 2
    assert "--save-every needs --save DIR" in capfd.readouterr().err
