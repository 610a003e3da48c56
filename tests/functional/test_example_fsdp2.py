"""``examples/fsdp2_lm_head.py`` under torchrun (4 gloo ranks) against one process.

The example prints the global mean loss of each AdamW step of a tiny decoder whose blocks
and output layer are each wrapped by ``fully_shard``, with our fused loss inside the output
layer's ``forward``. The oracle trains the same model (same seeds, global batch) in this
process, unwrapped, with the loss written as ``F.cross_entropy`` on the full logits: so
the comparison checks FSDP2's gathers and gradient averaging and the fused loss together.
Matching the losses after the first step checks every parameter's gradient.
Tolerance: 1e-5 absolute on losses near 4.6 (measured: within 1e-6): fp32 sums in another
order (FSDP's reduce-scatter, the loss's vocab chunks; ~1e-7 relative) through three
AdamW steps, plus the example's 6-decimal printing (5e-7).

Device: none. The example runs under torchrun with ``--backend gloo`` (CPU); the oracle
runs in the pytest process, which must not touch CUDA (ranks forked later would fail).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import torch.nn.functional as F

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_lm_head.py"
STEPS, LR = 3, 1e-2


def _example_module():
    spec = importlib.util.spec_from_file_location("fsdp2_lm_head_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines classes and functions only; main() is not run
    return module


def _oracle_losses(ex) -> list[float]:
    model = ex.TinyDecoder()
    opt = ex.optimizer(model, LR)
    ids, labels = ex.global_batch()
    losses = []
    for _ in range(STEPS):
        h = F.rms_norm(model.hidden(ids), (ex.H,))
        loss = F.cross_entropy((h @ model.out.weight.t()).flatten(0, 1), labels.flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_fsdp2_example_trains_like_one_process():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = str(EXAMPLE.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(EXAMPLE), "--steps", str(STEPS), "--lr", str(LR), "--backend", "gloo",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = re.findall(rf"^step (\d+)/{STEPS}  loss (\d+\.\d+)$", proc.stdout, re.M)
    assert [int(s) for s, _ in printed] == list(range(1, STEPS + 1)), proc.stdout
    losses = [float(v) for _, v in printed]
    expected = _oracle_losses(_example_module())
    assert expected[-1] < expected[0]  # the oracle itself learns: the comparison has teeth
    for got, want in zip(losses, expected):
        assert abs(got - want) < 1e-5, (losses, expected)
