"""LM-head loss accuracy: max |error| against fp64 per input dtype and path (one process).

For each input dtype (fp32, bf16, fp16) the hidden states and weight are drawn once and
cast; the reference is plain torch in fp64 on the *same* (cast) values, so the table
shows the error the loss adds, not the error of the cast. Columns: log-probs
(``*_logprobs``), per-token cross-entropy, and the cross-entropy's gradients w.r.t.
hidden and weight (``sum`` of the per-token losses), which are returned in the input dtype:
the "floor" columns are the error of the fp64 gradients merely rounded to that dtype (no
path can beat them). Paths: materialized = fp32 logits
``F.linear(h.float(), w.float())`` into ``vocab_parallel_*`` (default / ``invariant``);
fused = ``fused_linear_*`` (default / ``invariant``); ``fused, logits_precision=input``
= the old rounding mode (matmuls in the input dtype). Shapes from issue 16.

    .venv/bin/python bench/lm_head_accuracy.py
    TRITON_INTERPRET=1 .venv/bin/python bench/lm_head_accuracy.py --engine triton

``--engine triton``: the fused paths on the triton engine (default and invariant mode;
under Triton's CPU interpreter here, its cuBLAS products by their CPU stand-ins), the
materialized and ``precision=input`` paths left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

from mp_bridge.layers import (
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
)

SHAPES = ((40, 80, 300), (256, 512, 8192))  # (N, H, V)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PATHS = ("materialized", "materialized inv", "fused", "fused inv", "fused, precision=input")


def _inputs(n, h, v, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * (4 / h**0.5)).to(dtype)  # logits ~ N(0, 16)
    target = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, target


def _ours(path, hidden, weight, target, engine="torch"):
    inv = "inv" in path
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if path.startswith("materialized"):
        logits = F.linear(h.float(), w.float())
        lp = vocab_parallel_logprobs(logits.detach(), target, invariant=inv)
        ce = vocab_parallel_cross_entropy(logits, target, invariant=inv)
    else:
        kw = {"invariant": inv} if engine == "torch" else {"invariant": inv, "engine": engine}
        if "precision=input" in path:
            kw["logits_precision"] = "input"
        lp = fused_linear_logprobs(hidden, weight, target, **kw)
        ce = fused_linear_cross_entropy(h, w, target, reduction="none", **kw)
    ce.sum().backward()
    return lp, ce.detach(), h.grad, w.grad


def _reference(hidden, weight, target):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits = h @ w.t()
    lp = torch.log_softmax(logits.detach(), -1).gather(1, target[:, None])[:, 0]
    ce = F.cross_entropy(logits, target, reduction="none")
    ce.sum().backward()
    return lp, ce.detach(), h.grad, w.grad


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="torch", choices=("torch", "triton"))
    engine = p.parse_args(argv).engine
    paths = PATHS if engine == "torch" else ("fused", "fused inv")
    warnings.filterwarnings("ignore")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, CPU, {threads} threads, TP 1, {engine} engine\n")
    print(
        "| N, H, V | dtype | path | log-probs | loss | d hidden | d weight "
        "| floor d hidden | floor d weight |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, h, v in SHAPES:
        for dtype in DTYPES:
            hidden, weight, target = _inputs(n, h, v, dtype)
            ref = _reference(hidden, weight, target)
            floor = [(g.to(dtype).double() - g).abs().max().item() for g in ref[2:]]
            for path in paths:
                if "precision=input" in path and dtype == torch.float32:
                    continue  # same as "fused" for fp32
                ours = _ours(path, hidden, weight, target, engine)
                errs = [(a.double() - b).abs().max().item() for a, b in zip(ours, ref)]
                cells = " | ".join(f"{e:.2e}" for e in errs + floor)
                print(f"| {n}, {h}, {v} | {str(dtype)[6:]} | {path} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
