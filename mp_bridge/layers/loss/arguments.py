"""The argument checks of the five loss doors (materialized and fused), run before any
collective by ``options.parse_loss_options``.

Each check raises ``TypeError`` / ``ValueError`` naming the argument, the value and the
fix, built on the validators of ``mp_bridge.checks`` (``check_bool`` and ``check_float``
are theirs, re-exported); ``forbid_double_backward`` is the one refusal of
``create_graph=True`` the losses' autograd Functions share. What the TP ranks agree on
is the parsed ``LossOptions`` (``options``), not anything here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_bridge.checks import (
    check_bool,
    check_choice,
    check_float,
    check_group,
    check_int,
    check_positive_float,
    is_int,
)
from mp_bridge.checks import forbid_double_backward as _forbid_double_backward
from mp_bridge.comm import group_rank, group_size
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = [
    "REDUCTIONS",
    "check_bool",
    "check_ce_weight",
    "check_chunk_size",
    "check_float",
    "check_fused_inputs",
    "check_has_values",
    "check_ignore_index",
    "check_logits",
    "check_reduction",
    "check_options",
    "check_shard",
    "check_target",
    "check_temperature",
    "check_vocab_size",
    "forbid_double_backward",
]

REDUCTIONS = ("mean", "sum", "none")


def check_vocab_size(vocab_size: object, padded: int, v_local: int, tp_size: int) -> int:
    """Validate ``vocab_size`` (``None`` = no padding) against the padded vocab; return it."""
    if vocab_size is None:
        return padded
    check_int("vocab_size", vocab_size, fix="pass an int or None")
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} must be in [1, {padded}]: the shard holds V_local="
            f"{v_local} rows on each of {tp_size} TP ranks (padded vocab {padded}); pass the "
            "true vocab size, or shard with vocab_shard_ranges(vocab_size, tp_size)"
        )
    return vocab_size


def check_shard(v_local: int, vocab_size: object, tp_group: dist.ProcessGroup | None) -> VocabShard:
    """This rank's :class:`VocabShard` of ``v_local`` rows; ``vocab_size`` validated."""
    check_group("tp_group", tp_group)
    tp = group_size(tp_group)
    vocab = check_vocab_size(vocab_size, v_local * tp, v_local, tp)
    return VocabShard.of_rank(tp, v_local, rank=group_rank(tp_group), vocab_size=vocab)


def check_logits(
    logits: object, tp_group: dist.ProcessGroup | None, vocab_size: object
) -> VocabShard:
    """Validate vocab-parallel ``logits [..., V_local]`` and ``vocab_size``; return the shard."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got dtype={logits.dtype}")
    check_has_values("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must be [..., V_local] with V_local >= 1, got {tuple(logits.shape)}"
        )
    return check_shard(logits.shape[-1], vocab_size, tp_group)


def check_fused_inputs(
    hidden: object, weight: object, chunk_size: object, shard_rows: int | None = None
) -> None:
    """``hidden [..., H]`` and ``weight [V_local, H]`` floating, same H, dtype and device;
    ``V_local >= 1`` unless ``shard_rows`` is given (a ``DTensor`` weight's shard, which
    holds ``V_local <= shard_rows`` rows: the last ones of ``torch.chunk`` may hold none)."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating torch.Tensor, got {type(x).__name__}")
        check_has_values(name, x)
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"need hidden [..., H] and weight [V_local, H] with the same H, got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    # else the empty shard would surface as a target out of range
    if shard_rows is None and weight.shape[0] < 1:
        raise ValueError(
            f"weight must be this rank's vocab shard [V_local, H] with V_local >= 1, got "
            f"{tuple(weight.shape)}; pass the LM head's local rows (every TP rank holds "
            "V_local >= 1 rows: shard with vocab_shard_ranges(vocab_size, tp_size))"
        )
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise TypeError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, "
            f"{weight.device}) must share dtype and device; cast one, e.g. "
            "hidden.to(weight.dtype) (the loss accumulates in fp32 either way)"
        )
    check_chunk_size(chunk_size)


def check_has_values(name: str, x: torch.Tensor) -> None:
    """``x`` holds values: not a ``meta`` tensor (shape and dtype only), which would fail
    later inside a kernel or a host sync with a bare ``RuntimeError``."""
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor (device='meta', shape {tuple(x.shape)}: no values), so "
            f"no loss can be computed from it; pass {name} on a real device (a model built "
            "on meta needs module.to_empty(device=...) and its weights loaded first)"
        )


def check_chunk_size(chunk_size: object) -> None:
    """``None`` or a positive int."""
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, low=1, fix="or None for the default")


def check_reduction(reduction: object) -> str:
    """One of ``REDUCTIONS``."""
    return check_choice("reduction", reduction, REDUCTIONS)


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
    check_has_values("target", target)
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


def check_ignore_index(ignore_index: object) -> int | None:
    """``None`` (no id is ignored) or an int (default -100 on every loss)."""
    if ignore_index is not None and not is_int(ignore_index):
        raise TypeError(
            f"ignore_index must be an int or None (default -100; None ignores no id), "
            f"got {ignore_index!r}"
        )
    return ignore_index


def check_temperature(
    temperature: object, shape: tuple[int, ...], like: torch.Tensor, *, shape_of: str = ""
) -> float | torch.Tensor:
    """A finite float > 0 (1.0 = no scaling), or a tensor of them per token / per sample.

    The tensor must be floating, on ``like``'s device, broadcastable to the token shape
    ``shape`` (``shape_of`` says where it comes from), finite and > 0 everywhere (one host
    sync), and must not require grad: the losses treat it as a constant and compute no
    ``d loss / d temperature``, so a learnable temperature would silently stay unchanged.
    Returns the float, or the tensor broadcast (a view) to ``shape``.
    """
    if isinstance(temperature, torch.Tensor):
        return _check_temperature_tensor(temperature, tuple(shape), like, shape_of)
    return check_positive_float(
        "temperature", temperature, fix="pass a float or a floating tensor (1.0 = none)"
    )


def _check_temperature_tensor(
    t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor, shape_of: str
) -> torch.Tensor:
    if not t.is_floating_point():
        raise TypeError(
            f"temperature must be a floating tensor, got dtype={t.dtype}; e.g. temperature.float()"
        )
    _check_constant("temperature", t, like, "it scales the logits as a constant")
    try:
        ok = torch.broadcast_shapes(tuple(t.shape), shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"temperature shape {tuple(t.shape)} must broadcast to the tokens' shape "
            f"{shape_of}{shape}: one value per token, or e.g. [B, 1] per sample of "
            "[B, S] tokens (temperature[:, None]), or a 0-dim tensor"
        )
    if t.numel() and not bool((torch.isfinite(t) & (t > 0)).all()):
        bad = t[~(torch.isfinite(t) & (t > 0))].flatten()[0].item()
        raise ValueError(
            f"temperature must be finite and > 0 everywhere, got {bad!r}; clamp it, e.g. "
            "temperature.clamp(min=1e-3)"
        )
    return t.detach().broadcast_to(shape)


def check_ce_weight(ce_weight: object, vocab_size: int, like: torch.Tensor) -> torch.Tensor | None:
    """``None`` or per-class weights: a floating ``[vocab_size]`` tensor on ``like``'s device,
    without gradient, finite and >= 0 everywhere (one host sync), as ``F.cross_entropy``'s
    ``weight``. Returned detached (the parse casts it)."""
    if ce_weight is None:
        return None
    if not isinstance(ce_weight, torch.Tensor):
        raise TypeError(
            f"ce_weight must be a floating torch.Tensor of shape [vocab_size] or None, got "
            f"{type(ce_weight).__name__}; pass torch.tensor(weights, dtype=torch.float32)"
        )
    if not ce_weight.is_floating_point():
        raise TypeError(
            f"ce_weight must be a floating tensor, got dtype={ce_weight.dtype}; e.g. "
            "ce_weight.float()"
        )
    check_has_values("ce_weight", ce_weight)
    if tuple(ce_weight.shape) != (vocab_size,):
        raise ValueError(
            f"ce_weight shape {tuple(ce_weight.shape)} must be [vocab_size] = ({vocab_size},): "
            "one weight per true class of the full vocab, identical on every TP rank (not "
            "this rank's shard, no padding rows)"
        )
    _check_constant("ce_weight", ce_weight, like, "a constant per-class factor")
    ok = torch.isfinite(ce_weight) & (ce_weight >= 0)
    if not bool(ok.all()):
        bad = ce_weight[~ok].flatten()[0].item()
        raise ValueError(
            f"ce_weight must be finite and >= 0 everywhere, got {bad!r}; e.g. "
            "ce_weight.clamp(min=0)"
        )
    return ce_weight.detach()


def _check_constant(name: str, t: torch.Tensor, like: torch.Tensor, role: str) -> None:
    """``t`` is on ``like``'s device and does not require grad (no gradient flows to it)."""
    if t.device != like.device:
        raise ValueError(
            f"{name} is on {t.device} but the logits / hidden states are on "
            f"{like.device}; pass {name}.to({like.device!s})"
        )
    if t.requires_grad:
        raise ValueError(
            f"{name} requires grad, but the losses compute no gradient with respect to "
            f"it ({role}); pass {name}.detach()"
        )


def check_options(
    *,
    softcap: object = None,
    z_loss_weight: object = 0.0,
    ignore_index: object = None,
    flags: dict[str, object] | None = None,
) -> tuple[float | None, float, int | None]:
    """The RL-head options: ``softcap`` None or a finite float > 0, ``z_loss_weight`` a
    finite float >= 0, ``ignore_index`` None or an int, every ``flags`` value a bool."""
    if softcap is not None:
        softcap = check_positive_float("softcap", softcap, fix="None = no cap")
    z_loss_weight = check_float(
        "z_loss_weight",
        z_loss_weight,
        low=0.0,
        open_high=True,
        fix="0 = none",
    )
    ignore_index = check_ignore_index(ignore_index)
    for name, flag in (flags or {}).items():
        check_bool(name, flag)
    return softcap, float(z_loss_weight), ignore_index


def forbid_double_backward(name: str) -> None:
    """Raise in a ``backward`` run with ``create_graph=True`` (grad mode on).

    The losses' backward formulas reuse statistics saved in forward as constants, so a
    graph built through them would give a silently wrong second derivative.
    """
    _forbid_double_backward(
        name,
        "its backward treats forward statistics as constants; take higher derivatives "
        "through torch ops on materialized full logits instead",
    )
