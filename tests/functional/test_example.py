"""``examples/colocated_mimo.py`` under torchrun (4 gloo ranks) against one process.

The example prints the loss of each SGD step; the oracle trains the same model (same full
weights and global batch, which the example draws from fixed seeds) in plain torch on the
full tensors: linear encoder, embedding, causal softmax attention, LM head, mean
cross-entropy over the supervised tokens. Matching the losses after the first step checks
the gradients of every parameter, including the encoder's through the bridge.
Tolerance: 2e-5 absolute on losses near 6.9: fp32 sums in a different order across ranks
(relative error ~1e-6) plus the example's 6-decimal printing.

Device: none. The example runs under torchrun with ``--backend gloo`` (CPU); the oracle
runs in the pytest process, which must not touch CUDA (ranks forked later would fail).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "colocated_mimo.py"
STEPS, LR = 3, 0.5


def _example_module():
    spec = importlib.util.spec_from_file_location("colocated_mimo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; main() is not run
    return module


def _oracle_losses(ex) -> list[float]:
    w = {k: t.clone().requires_grad_() for k, t in ex.full_weights().items()}
    data = ex.global_batch()
    d = ex.H // ex.HEADS
    causal = torch.ones(ex.S, ex.S).tril().bool()
    losses = []
    for _ in range(STEPS):
        x = torch.cat([data["pixels"] @ w["encoder"].t(), w["embedding"][data["ids"]]], dim=1)
        q = x.view(ex.B, ex.S, ex.HEADS, d).transpose(1, 2)  # [B, heads, S, d]
        scores = (q @ q.transpose(-1, -2)) / math.sqrt(d)
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ q
        logits = attn.transpose(1, 2).reshape(ex.B, ex.S, ex.H) @ w["head"].t()
        ce = F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), reduction="none")
        loss = (ce * data["mask"].flatten()).sum() / data["mask"].sum()
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, list(w.values()))
        with torch.no_grad():
            for p, g in zip(w.values(), grads):
                p -= LR * g
    return losses


def test_example_trains_like_one_process():
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
        assert abs(got - want) < 2e-5, (losses, expected)
