"""The speed stage's float64 reference (``bench/gpu/speed.py``'s precision columns): the
mean cross-entropy of ``h @ w.T`` and its gradients on the *same* low-precision inputs,
exact products of their values, and the normwise relative error against it."""

from __future__ import annotations

import torch


def fp64_reference(h, w, t, chunk: int = 1024):
    """fp64 ``(mean loss, d hidden, d weight, target log-probs [N])`` of the mean
    cross-entropy of ``h @ w.T`` on the same inputs, tokens in chunks (``[chunk, V]`` fp64
    logits at a time)."""
    w64 = w.detach().double()
    lp = torch.empty(h.shape[0], dtype=torch.float64, device=h.device)
    gh = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    gw = torch.zeros_like(w64)
    n = h.shape[0]
    for s in range(0, n, chunk):
        hc, tc = h.detach()[s : s + chunk].double(), t[s : s + chunk]
        z = hc @ w64.t()
        lp[s : s + chunk] = z.gather(1, tc[:, None])[:, 0] - torch.logsumexp(z, dim=1)
        p = torch.softmax(z, dim=1)
        del z
        p.scatter_add_(1, tc[:, None], p.new_full((tc.shape[0], 1), -1.0)).div_(n)
        gh[s : s + chunk] = p @ w64
        gw.addmm_(p.t(), hc)
        del p
    return -lp.mean(), gh, gw, lp


def rel_err(a: torch.Tensor | None, ref: torch.Tensor) -> float | None:
    if a is None:
        return None
    return ((a.double() - ref).norm() / ref.norm()).item()
