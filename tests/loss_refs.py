"""fp64 reference of every loss / log-prob / entropy option, written with plain torch ops.

Import as ``from tests.loss_refs import reference``. Independent of ``mp_bridge``: the
soft-cap is ``c * tanh(x / c)``, then division by the temperature, then torch's
``log_softmax``; cross-entropy is ``-(1 - eps) log p_t - eps mean_c log p_c`` plus
``zw * logsumexp**2``; entropy ``-sum p log p`` (``0 log 0 = 0`` at ``-inf`` logits);
positions whose target equals ``ignore_index`` give 0 everywhere.
"""

from __future__ import annotations

import torch

__all__ = ["reference"]


def reference(
    z: torch.Tensor,
    target: torch.Tensor,
    *,
    kind: str,
    temperature: float = 1.0,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    ignore_index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, entropy, z_loss)`` per token of logits ``z [..., V]`` (any dtype; fp64
    math); ``kind`` "ce" (loss incl. z-loss) or "logprob"."""
    z = z.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, -1)
    keep = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        keep = target != ignore_index
    picked = logp.gather(-1, torch.where(keep, target, 0).unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    lse = torch.logsumexp(z, -1)
    z_loss = z_loss_weight * lse * lse
    if kind == "ce":
        eps = label_smoothing
        value = -(1 - eps) * picked + z_loss
        if eps:
            value = value - eps * logp.mean(-1)
    else:
        value = picked
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return tuple(torch.where(keep, v, zero) for v in (value, entropy, z_loss))
