"""Shared loss semantics and input checks for the fused and TP-invariant losses.

Both per-token losses are one affine form of the global statistics of ``z`` (fp32
logits, already divided by the temperature), over the true vocab of ``V`` ids:
``lse = log sum_c exp(z_c)``, ``tl = z_target``, ``sz = sum_c z_c``::

    value = a * lse + b * tl + c * sz         d value / d z = a * softmax(z) + b * onehot + c

- cross-entropy (``F.cross_entropy(label_smoothing=eps)``): ``a = 1, b = -(1 - eps),
  c = -eps / V``; ignored tokens get value 0 and gradient 0.
- log-prob ``log_softmax(z)[target]``: ``a = -1, b = 1, c = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LossSpec",
    "check_float",
    "check_loss_args",
    "check_target",
    "check_temperature",
    "check_vocab_size",
    "forbid_double_backward",
]


@dataclass(frozen=True)
class LossSpec:
    """Which per-token quantity to compute, and its constants."""

    kind: str  # "ce" | "logprob"
    vocab_size: int
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    temperature: float = 1.0

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, b, c)`` of the affine form in the module docstring."""
        if self.kind == "ce":
            eps = self.label_smoothing
            return 1.0, -(1.0 - eps), -eps / self.vocab_size
        return -1.0, 1.0, 0.0

    def token_weight(self, target: torch.Tensor) -> torch.Tensor:
        """fp32 per-token factor of ``d value / d logits``: ``1 / T``, 0 on ignored tokens."""
        w = torch.full(
            target.shape, 1.0 / self.temperature, dtype=torch.float32, device=target.device
        )
        if self.ignore_index is not None:
            w = w.masked_fill(target == self.ignore_index, 0.0)
        return w


def check_vocab_size(vocab_size: object, padded: int, v_local: int, tp_size: int) -> int:
    """Validate ``vocab_size`` (``None`` = no padding) against the padded vocab; return it."""
    if vocab_size is None:
        return padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int or None, got {vocab_size!r}")
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {padded}]: the shard holds V_local="
            f"{v_local} rows on each of {tp_size} TP ranks (padded vocab {padded}); pass the "
            "true vocab size, or shard with vocab_shard_ranges(vocab_size, tp_size)"
        )
    return vocab_size


def check_target(
    target: object,
    shape: tuple[int, ...],
    vocab_size: int,
    ignore_index: int | None,
    *,
    shape_of: str = "",
) -> torch.Tensor:
    """Validate class ids (one host sync) and return them as ``torch.long``.

    Any integer dtype is accepted (int32 / uint8 ids are common); the kernels index with
    int64. ``target`` must have ``shape`` (``shape_of`` says where that shape comes from)
    and hold ids in ``[0, vocab_size)`` or ``ignore_index``.
    """
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(
            f"target must hold integer class ids, got dtype={target.dtype}; "
            "pass class indices (e.g. target.long()), not probabilities or a mask"
        )
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal {shape_of}{tuple(shape)}")
    target = target.long()
    bad = (target < 0) | (target >= vocab_size)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bool(bad.any()):  # a wrong id would otherwise be a silent wrong loss
        allowed = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
        raise ValueError(
            f"target holds id {int(target[bad].flatten()[0])} outside [0, {vocab_size})"
            f"{allowed}; fix the labels, or pass the true vocab_size"
        )
    return target


def check_float(name: str, value: object, *, low: float, high: float, open_low: bool) -> float:
    """A float in ``(low, high]`` / ``[low, high]``, else ValueError/TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r}")
    ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bracket = "(" if open_low else "["
        raise ValueError(f"{name}={value!r} must be a float in {bracket}{low}, {high}]")
    return float(value)


def check_loss_args(ignore_index: object, label_smoothing: object) -> tuple[int, float]:
    """``ignore_index`` an int, ``label_smoothing`` a float in ``[0, 1]``."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int (default -100), got {ignore_index!r}")
    eps = check_float("label_smoothing", label_smoothing, low=0.0, high=1.0, open_low=False)
    return ignore_index, eps


def check_temperature(temperature: object) -> float:
    """A finite float > 0 (1.0 = no scaling)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float, got {temperature!r}")
    if not 0.0 < temperature < float("inf"):  # also rejects nan
        raise ValueError(f"temperature={temperature!r} must be a finite float > 0 (1.0 = none)")
    return float(temperature)


def forbid_double_backward(name: str) -> None:
    """Raise in a ``backward`` run with ``create_graph=True`` (grad mode on).

    The losses' backward formulas reuse statistics saved in forward as constants, so a
    graph built through them would give a silently wrong second derivative.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} cannot differentiate twice: backward(create_graph=True) is not "
            "supported (its backward treats forward statistics as constants, so a second "
            "derivative would be wrong); take higher derivatives through torch ops on "
            "materialized full logits instead"
        )
