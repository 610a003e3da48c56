"""fp64 reference of every loss / log-prob / entropy option, written with plain torch ops.

Import as ``from tests.loss_refs import reference``. Independent of ``mp_bridge``: the
soft-cap is ``c * tanh(x / c)``, then division by the temperature, then torch's
``log_softmax``; cross-entropy is ``-(1 - eps) log p_t - eps mean_c log p_c`` plus
``zw * logsumexp**2``; entropy ``-sum p log p`` (``0 log 0 = 0`` at ``-inf`` logits);
positions whose target equals ``ignore_index`` give 0 everywhere. A tensor temperature
(per token, broadcast to the target's shape) divides each token's row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Checks", "fp64_oracle", "reference", "sum_pi_squared", "weighted_cross_entropy"]


def reference(
    z: torch.Tensor,
    target: torch.Tensor,
    *,
    kind: str,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    ignore_index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value, entropy, z_loss)`` per token of logits ``z [..., V]`` (any dtype; fp64
    math); ``kind`` "ce" (loss incl. z-loss) or "logprob"."""
    z = _transformed(z, target, temperature, softcap)
    logp = torch.log_softmax(z, -1)
    keep = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        keep = target != ignore_index
    picked = logp.gather(-1, torch.where(keep, target, 0).unsqueeze(-1)).squeeze(-1)
    finite = torch.where(torch.isinf(logp), 0.0, logp)  # 0 log 0 = 0, and no nan gradient
    entropy = -(logp.exp() * finite).sum(-1)
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


def weighted_cross_entropy(
    z: torch.Tensor,
    target: torch.Tensor,
    ce_weight: torch.Tensor,
    *,
    reduction: str,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    ignore_index: int = -100,
    **transform,
) -> torch.Tensor:
    """Per-class weighted cross-entropy of ``z [..., V]`` in fp64: torch's own
    ``F.cross_entropy(weight=ce_weight, label_smoothing=, ignore_index=, reduction=)`` of
    the transformed logits (``transform``: ``temperature``, ``softcap``, as
    :func:`reference`), plus the unweighted z-loss ``zw * logsumexp**2`` of the counted
    tokens ("mean": over their number, as Liger-Kernel)."""
    kw = {"temperature": 1.0, "softcap": None, **transform}
    zt = _transformed(z, target, kw["temperature"], kw["softcap"])
    loss = torch.nn.functional.cross_entropy(
        zt.flatten(0, -2),
        target.flatten(),
        weight=ce_weight.double(),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    if z_loss_weight:
        keep = target != ignore_index
        z_loss = torch.where(keep, z_loss_weight * torch.logsumexp(zt, -1) ** 2, 0.0)
        if reduction == "none":
            return loss + z_loss
        return loss + z_loss.sum() / (keep.sum() if reduction == "mean" else 1)
    return loss


def _transformed(z, target, temperature, softcap) -> torch.Tensor:
    z = z.double()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double().broadcast_to(target.shape).unsqueeze(-1)
    return z / temperature


def sum_pi_squared(
    z: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int | None = None,
) -> torch.Tensor:
    """``sum_c softmax(softcap(z) / T)_c**2`` per token in fp64 (0 at ``ignore_index``)."""
    p = torch.softmax(_transformed(z, target, temperature, softcap), -1)
    out = (p * p).sum(-1)
    if ignore_index is not None:
        out = torch.where(target == ignore_index, 0.0, out)
    return out


def fp64_oracle(
    materialized: bool,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    vocab: int,
    outputs: Callable[[torch.Tensor], list[torch.Tensor]],
    ups: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(outputs, grads)`` of a loss path's fp64 reference on the full vocab.

    The leaves are fp64 copies: the logits ``hidden @ weight[:vocab].T`` (materialized:
    made in the input dtype, as the path gets them), else ``hidden`` and ``weight[:vocab]``
    (fused). ``outputs(z)``: the reference outputs of the fp64 logits ``z [..., vocab]``;
    ``ups(outs)``: an upstream gradient for each; ``grads``: of the leaves, after one
    backward of ``sum(out * up)`` over the outputs that have a gradient."""
    if materialized:
        leaves = [(hidden @ weight[:vocab].t()).double().requires_grad_()]
        z = leaves[0]
    else:
        leaves = [hidden.double().requires_grad_(), weight[:vocab].double().requires_grad_()]
        z = leaves[0] @ leaves[1].t()
    outs = outputs(z)
    sum((o * u).sum() for o, u in zip(outs, ups(outs)) if o.requires_grad).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


class Checks:
    """Collect failures and raise at the end of a multi-rank case: a rank leaving a case
    early would leave its peers waiting in the next collective (a hang, not a report)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def close(self, actual, expected, what, **tol) -> None:
        try:
            torch.testing.assert_close(actual.double(), expected.double(), **tol)
        except AssertionError as exc:
            self.failures.append(f"{what}: {exc}")

    def tp_point(self, what, got, ref, base, invariant: bool):
        """One TP size of a sweep: ``got`` and ``ref`` ``(outputs, grads)`` close (the fp32
        tolerance of the TP tests, 2e-5); with ``invariant`` bitwise equal to ``base`` (the
        first TP size's ``got``, which this returns for the next one)."""
        for i, (a, b) in enumerate(zip(got[0] + got[1], ref[0] + ref[1], strict=True)):
            self.close(a, b, f"{what} tensor {i} vs fp64", rtol=2e-5, atol=2e-5)
        if not invariant:
            return base
        base = got if base is None else base
        for i, (a, b) in enumerate(zip(got[0] + got[1], base[0] + base[1], strict=True)):
            self.equal(a, b, f"{what} tensor {i} vs the first TP size")
        return base

    def equal(self, actual, expected, what) -> None:
        if actual.shape != expected.shape:
            self.failures.append(f"{what}: shape {actual.shape} != {expected.shape}")
        elif not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            self.failures.append(f"{what}: not bitwise equal (max diff {diff:.3g})")

    def done(self) -> None:
        assert not self.failures, "\n".join(self.failures)
