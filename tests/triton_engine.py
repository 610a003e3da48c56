"""The ``"triton"`` loss engine for tests: interpreter setup, the call, the fp64 oracle.

Without CUDA the kernels run on CPU tensors under ``TRITON_INTERPRET=1``, which must be
set before ``triton`` itself is imported (its ``tl.zeros`` & co. are ``@jit`` functions
decorated then): ``tests/conftest.py`` sets it; this module sets it too for a script that
imports it first. Skips the importing test module when ``triton`` is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mp_bridge.layers import fused_linear_cross_entropy, fused_linear_logprobs  # noqa: E402
from tests.loss_refs import reference, sum_pi_squared  # noqa: E402

__all__ = ["DEVICE", "oracle", "run", "triton_loss"]

DOORS = {"ce": fused_linear_cross_entropy, "logprob": fused_linear_logprobs}
#: Where the engine runs: the GPU when there is one (compiled kernels; gloo carries CUDA
#: tensors between the test world's ranks), else the CPU (interpreted kernels).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_loss(kind: str, hidden, weight, target, **kw):
    """``fused_linear_cross_entropy`` (``kind="ce"``) / ``fused_linear_logprobs`` on the
    triton engine, on ``hidden``'s device (a tensor temperature is moved there)."""
    kw.setdefault("engine", "triton")
    if isinstance(kw.get("temperature"), torch.Tensor):
        kw["temperature"] = kw["temperature"].to(hidden.device)
    return DOORS[kind](hidden, weight, target, **kw)


def run(fn, hidden, weight, target, up_seed: int = 5, up=None, device=DEVICE):
    """``(outputs tuple, d hidden, d weight)`` (on the CPU) of ``fn(h, w, target)`` run on
    ``device``, with a seeded upstream gradient on each output that has one (``up``: the
    first one's instead)."""
    h = hidden.detach().to(device, copy=True).requires_grad_(True)
    w = weight.detach().to(device, copy=True).requires_grad_(True)
    target = target.to(device)
    out = fn(h, w, target)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(up_seed)
    loss = 0.0
    for i, o in enumerate(outs):
        if o.requires_grad:
            u = up if i == 0 and up is not None else torch.rand(o.shape, generator=g) + 0.5
            loss = loss + (o * u.to(o)).sum()
    loss.backward()
    return tuple(o.detach().cpu() for o in outs), h.grad.cpu(), w.grad.cpu()


def oracle(kind: str, vocab: int, **kw):
    """The fp64 reference ``fn(h, w, target)`` of ``triton_loss(kind, ..., **kw)`` on the
    full weight (its rows past ``vocab`` are padding)."""
    red = kw.get("reduction", "mean" if kind == "ce" else "none")
    ignore = kw.get("ignore_index", -100)
    opts = dict(
        temperature=kw.get("temperature", 1.0),
        softcap=kw.get("softcap"),
        ignore_index=ignore,
    )

    def fn(h, w, t):
        z = h.double() @ w.double()[:vocab].t()
        if kind == "ce":
            value, _, z_loss = reference(
                z, t, kind="ce", label_smoothing=kw.get("label_smoothing", 0.0),
                z_loss_weight=kw.get("z_loss_weight", 0.0), **opts,
            )  # fmt: skip
            outs = [value] + ([z_loss.detach()] if kw.get("return_z_loss") else [])
        else:
            value, entropy, _ = reference(z, t, kind="logprob", **opts)
            outs = [value]
            if kw.get("return_entropy"):
                outs.append(entropy)
            if kw.get("return_sum_pi_squared"):
                outs.append(sum_pi_squared(z, t, **opts).detach())
        counted = torch.ones_like(t, dtype=torch.bool) if ignore is None else t != ignore
        if red == "sum":
            outs = [o.sum() for o in outs]
        elif red == "mean":
            outs = [o.sum() / counted.sum() for o in outs]
        return tuple(outs) if len(outs) > 1 else outs[0]

    return fn
