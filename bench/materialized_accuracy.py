"""Materialized default losses: error against fp64, per option, at TP 1/2/4 (gloo on CPU).

Guards a change of the materialized default path's formulas: run before and after and
compare. fp32 logits ``~ N(0, 16)`` (plus a few ``-inf`` ids) are drawn once; the
reference is plain torch in fp64 on the same values. Columns: the max and the mean
|error| of the per-token values and of ``d logits`` (upstream gradient ``N(0, 1)`` per
token), over all tokens and ids (each rank's shard gathered in rank order).

    PYTHONPATH=$PWD .venv/bin/python bench/materialized_accuracy.py
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mp_bridge.layers import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from mp_bridge.testing import run_distributed

N, V = int(os.environ.get("ACC_N", 512)), 4096
CASES = (
    ("ce", {}),
    ("ce", {"label_smoothing": 0.1}),
    ("ce", {"z_loss_weight": 1e-3}),
    ("ce", {"temperature": 0.7, "softcap": 30.0}),
    ("logprobs", {"temperature": 0.7}),
    ("logprobs", {"return_entropy": True}),
    ("entropy", {}),
    ("entropy", {"softcap": 30.0}),
)


def _inputs():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(N, V, generator=g) * 4
    logits[3, 100:200] = float("-inf")
    target = torch.randint(0, V, (N,), generator=g)
    target[::7] = -100
    upstream = torch.randn(N, generator=g)
    return logits, target, upstream


def _reference(kind, opts, logits, target, upstream):
    z = logits.double().requires_grad_()
    x = z
    if opts.get("softcap") is not None:
        x = opts["softcap"] * torch.tanh(x / opts["softcap"])
    x = x / opts.get("temperature", 1.0)
    valid = target.clamp(min=0)
    keep = target != -100
    if kind == "ce":
        val = F.cross_entropy(
            x, target, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0)
        )
        val = val + opts.get("z_loss_weight", 0.0) * torch.logsumexp(x, -1) ** 2 * keep
    else:
        logp = torch.log_softmax(x, -1)
        if kind == "logprobs":
            val = logp.gather(-1, valid[:, None])[:, 0]
            if opts.get("return_entropy"):
                val = val - (logp.exp() * torch.where(logp.exp() > 0, logp, 0.0)).sum(-1)
        else:
            val = -(logp.exp() * torch.where(logp.exp() > 0, logp, 0.0)).sum(-1)
    (val * upstream.double()).sum().backward()
    return val.detach(), z.grad


def _ours(kind, opts, logits, target, upstream, group, rows):
    x = logits[:, rows].clone().requires_grad_()
    if kind == "ce":
        val = vocab_parallel_cross_entropy(x, target, tp_group=group, **opts)
    elif kind == "logprobs":
        val = vocab_parallel_logprobs(x, target.clamp(min=0), tp_group=group, **opts)
        if opts.get("return_entropy"):
            val = val[0] + val[1]
    else:
        val = vocab_parallel_entropy(x, tp_group=group, **opts)
    (val * upstream).sum().backward()
    grads = [torch.empty_like(x.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, x.grad.contiguous())
    return val.detach(), torch.cat(grads, dim=-1)


def _errors() -> list[tuple[str, list[float]]]:
    tp, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * V // tp, (rank + 1) * V // tp)
    logits, target, upstream = _inputs()
    out = []
    for kind, opts in CASES:
        ref = _reference(kind, opts, logits, target, upstream)
        ours = _ours(kind, opts, logits, target, upstream, dist.group.WORLD, rows)
        errs = []
        for a, b in zip(ours, ref):
            err = (a.double() - b).abs()
            err = err[torch.isfinite(b)]
            errs += [err.max().item(), err.mean().item()]
        out.append((f"{kind} {opts}", errs))
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"torch {torch.__version__}, CPU, N={N}, V={V}, fp32 logits ~ N(0, 16)\n")
    print("| TP | loss, options | max value | mean value | max d logits | mean d logits |")
    print("|---|---|---|---|---|---|")
    for tp in (1, 2, 4):
        for name, errs in run_distributed(_errors, tp)[0]:
            cells = " | ".join(f"{e:.3e}" for e in errs)
            print(f"| {tp} | {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
