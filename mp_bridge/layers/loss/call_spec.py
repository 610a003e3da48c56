"""One loss call parsed at the door: every option validated once into a frozen spec.

The five loss entry points (``vocab_parallel_*`` over logits ``[..., V_local]``,
``fused_linear_*`` over ``hidden [..., H]`` and ``weight [V_local, H]``) share this
parse: input tensors, then the scalar options, then the shard (``tp_group``,
``vocab_size``), ``target [...]`` and ``temperature``; each check raises ``TypeError`` /
``ValueError`` naming the argument before any collective. The resulting
:class:`LossCall` builds the engine's ``LossSpec`` and assembles the returned outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import FrozenSpec, check_float
from mp_bridge.layers.loss.checks import (
    check_fused_inputs,
    check_logits,
    check_options,
    check_reduction,
    check_shard,
    check_target,
    check_temperature,
)
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.outputs import counted_tokens, returned
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = ["KINDS", "PRECISIONS", "LossCall", "parse_loss_call"]

#: ``"ce"``: cross-entropy (+ z-loss); ``"logprob"``: selected-token log-probs (+ entropy,
#: ``sum_pi_squared``); ``"entropy"``: the entropy alone (``target`` optional).
KINDS = ("ce", "logprob", "entropy")
PRECISIONS = ("fp32", "input")


@dataclass(frozen=True)
class LossCall(FrozenSpec):
    """The validated options of one loss call.

    ``target``: ``torch.long`` ids of the token shape (``None`` only for an entropy
    without targets). ``temperature``: the float of the ``LossSpec`` (1.0 when a tensor
    was given); ``token_temperature``: the tensor broadcast (a view) to the token shape,
    or ``None``. ``flags``: the call's bool options (``invariant``, ``return_*``), by name.
    """

    kind: str
    shard: VocabShard
    target: torch.Tensor | None
    reduction: str
    ignore_index: int | None
    label_smoothing: float
    softcap: float | None
    z_loss_weight: float
    temperature: float
    token_temperature: torch.Tensor | None
    flags: tuple[tuple[str, bool], ...] = ()
    tp_group: dist.ProcessGroup | None = None
    chunk_size: int | None = None  # fused: rows per chunk (None: the default)
    logits_precision: str = "fp32"  # fused: "fp32" or "input"

    def flag(self, name: str) -> bool:
        return dict(self.flags).get(name, False)

    @property
    def temperature_arg(self) -> float | torch.Tensor:
        """The validated temperature as the caller passed it: the float or the tensor."""
        return self.temperature if self.token_temperature is None else self.token_temperature

    def spec(self, vocab_size: int | None = None) -> LossSpec:
        """The engine's ``LossSpec`` over ``vocab_size`` true classes (default the shard's)."""
        vocab = self.shard.vocab_size if vocab_size is None else vocab_size
        if self.kind == "ce":
            return LossSpec.cross_entropy(
                vocab,
                self.ignore_index,
                self.label_smoothing,
                temperature=self.temperature,
                softcap=self.softcap,
                z_loss_weight=self.z_loss_weight,
            )
        entropy = self.kind == "entropy"
        return LossSpec.logprob(
            vocab,
            self.temperature,
            # no target: no id is ignored (the engine's placeholder ids own no column)
            ignore_index=None if self.target is None else self.ignore_index,
            softcap=self.softcap,
            entropy=entropy or self.flag("return_entropy"),
            sum_pi_squared=not entropy and self.flag("return_sum_pi_squared"),
        )

    def returned(self, values: torch.Tensor, extra: torch.Tensor, sq: torch.Tensor):
        """The requested per-token outputs ``[...]`` of the engine's ``(values, extra,
        sq)``, reduced by ``reduction``: one tensor or a tuple (see ``outputs``)."""
        counted = counted_tokens(self.target, self.ignore_index)
        if self.kind == "entropy":
            return returned([extra], counted, self.reduction)
        if self.kind == "logprob":
            outputs = [
                values,
                extra if self.flag("return_entropy") else None,
                sq if self.flag("return_sum_pi_squared") else None,
            ]
            return returned(outputs, counted, self.reduction)
        z_loss = None
        if self.flag("return_z_loss"):
            z_loss = (
                extra.view(values.shape) if extra.numel() else torch.zeros_like(values.detach())
            )
        return returned([values, z_loss], counted, self.reduction)


def _check_precision(logits_precision: object) -> None:
    if logits_precision not in PRECISIONS:
        raise ValueError(
            f"logits_precision={logits_precision!r} must be one of {PRECISIONS} ('fp32': "
            "exact fp32-accumulated logits; 'input': logits rounded to the input dtype)"
        )


def parse_loss_call(kind: str, args: Mapping[str, object]) -> LossCall:
    """Validate one call of a ``kind`` loss (``KINDS``); return it.

    ``args``: the entry point's arguments by name (its ``locals()`` at the door): either
    ``logits``, or (fused) ``hidden``, ``weight``, ``chunk_size`` and
    ``logits_precision``; ``target``, ``tp_group``, ``vocab_size``, ``reduction``,
    ``ignore_index``, ``softcap``, ``temperature``, on the cross-entropy
    ``label_smoothing`` and ``z_loss_weight``; the bool options ``invariant`` and
    ``return_*``.
    """
    tp_group, vocab_size = args["tp_group"], args["vocab_size"]
    fused = "hidden" in args
    if fused:
        like, weight = args["hidden"], args["weight"]
        check_fused_inputs(like, weight, args["chunk_size"])
        _check_precision(args["logits_precision"])
        shard = check_shard(weight.shape[0], vocab_size, tp_group)
        shape_of = f"the leading dims of hidden {tuple(like.shape)}: "
    else:
        like = args["logits"]
        shard = check_logits(like, tp_group, vocab_size)
        shape_of = f"logits shape {tuple(like.shape)} without the vocab dim "
    tokens = tuple(like.shape[:-1])
    eps = 0.0
    if kind == "ce":
        eps = check_float(
            "label_smoothing", args["label_smoothing"], low=0.0, high=1.0, open_low=False
        )
    flags = {k: v for k, v in args.items() if k == "invariant" or k.startswith("return_")}
    softcap, zw, ignore_index = check_options(
        softcap=args["softcap"],
        z_loss_weight=args.get("z_loss_weight", 0.0),
        ignore_index=args["ignore_index"],
        flags=flags,
    )
    reduction = check_reduction(args["reduction"])
    target = args["target"]
    if target is not None:
        target = check_target(target, tokens, shard.vocab_size, ignore_index, shape_of=shape_of)
    temp = check_temperature(args["temperature"], tokens, like, shape_of=shape_of)
    token_temp = temp if isinstance(temp, torch.Tensor) else None
    return LossCall(
        kind,
        shard,
        target,
        reduction,
        ignore_index,
        eps,
        softcap,
        zw,
        1.0 if token_temp is not None else temp,
        token_temp,
        tuple((name, bool(flag)) for name, flag in flags.items()),
        tp_group,
        args["chunk_size"] if fused else None,
        args["logits_precision"] if fused else "fp32",
    )
