"""``mp-bridge demo --hf``'s pieces in one process: the synthetic HF batches (literal
positions), the flags it refuses (exit 2 before any rank starts), and its oracle
(:func:`compare_with_transformers`) passing our single-process reference trained like
transformers and failing it with one weight or one gradient moved."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from mp_bridge.cli import main  # noqa: E402
from mp_bridge.models import ReferenceMimo  # noqa: E402
from mp_bridge.models.hf import config_from_hf, hf_batch, load_hf  # noqa: E402
from mp_bridge.models.hf.hf_parity import (  # noqa: E402
    compare_with_transformers,
    train_transformers,
)
from mp_bridge.models.hf.hf_synthetic import llava_inputs, synthetic_llava_inputs  # noqa: E402
from mp_bridge.models.hf.tiny import tiny_llava  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "qwen2-clip")
    tiny_llava("qwen2", "clip").save_pretrained(path)
    return path


def test_llava_inputs_lay_out_images_and_right_padding(hf_dir):
    cfg = config_from_hf(hf_dir, seq_len=16)  # CLIP, 4 patches, "default": 4 placeholders
    ids, pixels, mask, labels = llava_inputs(cfg, (2, 0), pad=(3,))
    assert (ids[0] == 63).nonzero().flatten().tolist() == [1, 2, 3, 4, 6, 7, 8, 9]
    assert not (ids[1] == 63).any() and pixels.shape == (2, 3, 8, 8)
    assert mask[0].tolist() == [1] * 13 + [0] * 3 and mask[1].all()
    assert (labels[0, [1, 6, 13, 15]] == -100).all() and (labels[0, [0, 5, 10]] >= 0).all()
    with pytest.raises(ValueError, match="sample 0: 3 images of 4 placeholders and pad 3"):
        llava_inputs(cfg, (3,), pad=(3,))


def test_synthetic_batches_are_seeded_ragged_and_read_by_hf_batch(hf_dir):
    cfg = config_from_hf(hf_dir, seq_len=16)
    a, b = synthetic_llava_inputs(cfg, 8, seed=5), synthetic_llava_inputs(cfg, 8, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    per_sample = (a.input_ids == 63).sum(1) // 4
    assert per_sample.max() <= 3 and int(per_sample.sum()) == a.pixel_values.shape[0] >= 1
    batch = hf_batch(cfg, a.input_ids, a.pixel_values, a.labels, a.attention_mask)
    assert batch.batch_size == 8 and float(batch.loss_mask.sum()) > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--uniform"], "--uniform does not apply to --hf"),
        (["--save", "ckpt"], "--save does not apply to --hf"),
        (["--images", "long-tail"], "--images long-tail does not apply to --hf"),
        (["--llm", "tp=8"], "llm_kv_heads=4 is not divisible by llm tp=8"),
        (
            ["--llm", "tp=2,cp=4", "--cp-comm", "a2a"],
            r"q heads 4 and k/v heads 2 must each divide by 4",
        ),
        (["--llm", "tp=2,pp=4"], "--llm pp=4 needs one text layer per stage; .* has 2"),
        (["--batch-size", "6"], "--batch-size 6 does not split over --encoder dp=4"),
    ],
)
def test_flags_that_do_not_apply_exit_2(hf_dir, argv, message, capsys):
    assert main(["demo", "--hf", hf_dir, *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_a_missing_directory_exits_2(tmp_path, capsys):
    assert main(["demo", "--hf", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _ours(path, cfg, batches, steps, lr):
    """Our single-process reference trained like ``train_transformers``."""
    model = ReferenceMimo(cfg)
    load_hf(path, model)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        ids, pixels, mask, labels = batches[step % len(batches)]
        b = hf_batch(cfg, ids, pixels, labels, mask)
        x = (b.images.tokens if b.ragged else b.images).clone().requires_grad_(True)
        optim.zero_grad(set_to_none=True)
        loss = model(b.input_ids, b.labels, b.loss_mask, b.images.with_tokens(x) if b.ragged else x)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            input_grads = {0: x.grad.clone()}
        optim.step()
        losses.append(loss.item())
    return losses, grads, dict(model.state_dict()), input_grads


def test_the_oracle_passes_a_faithful_run_and_catches_one_moved_tensor(hf_dir):
    cfg, lr = config_from_hf(hf_dir, seq_len=16), 1e-3
    batches = [synthetic_llava_inputs(cfg, 4, seed=s) for s in (1, 2)]
    run = train_transformers(hf_dir, batches, steps=3, lr=lr)
    losses, grads, weights, input_grads = _ours(hf_dir, cfg, batches, 3, lr)

    def compare(grads=grads, weights=weights):
        return compare_with_transformers(
            cfg, run, losses=losses, first_grads=grads, weights=weights,
            input_grads=input_grads, first_batch=batches[0], encoder_dp=1,
        )  # fmt: skip

    good = compare()
    assert good.passed() and not good.unmatched and good.compared > 60, good.checks()
    name = "llm.layers.0.mlp.fc2.weight" if "llm.layers.0.mlp.fc2.weight" in weights else None
    name = name or next(n for n in weights if n.startswith("llm.") and n.endswith("weight"))
    moved = dict(weights, **{name: weights[name] + 0.1 * lr})  # a tenth of one Adam step
    bad = compare(weights=moved)
    assert not bad.passed() and bad.checks()[3][-1] is False, bad.checks()
    scaled = dict(grads, **{name: 2 * grads[name]})  # a gradient summed twice
    assert compare(grads=scaled).checks()[1][-1] is False
