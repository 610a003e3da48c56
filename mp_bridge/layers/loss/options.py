"""One loss call parsed at the door into one frozen :class:`LossOptions`.

The five loss doors (``vocab_parallel_cross_entropy`` / ``_logprobs`` / ``_entropy`` over
logits ``[..., V_local]``; ``fused_linear_cross_entropy`` / ``_logprobs`` over ``hidden
[..., H]`` and ``weight [V_local, H]``) each call ``parse_loss_options(kind, ...)`` with
their arguments by name:
input tensors, then the scalar options, then the shard (``tp_group``, ``vocab_size``),
``target [...]``, ``temperature`` and (fused) the engine; each check (``arguments``)
raises ``TypeError`` / ``ValueError`` naming the argument before any collective. The
result is the one object the TP ranks agree on (:meth:`LossOptions.agree`), the one an
engine receives (``engines/protocol.py``), and it assembles the returned outputs.

A new loss option ``foo`` touches the options, the formulas and the kernels, nothing else:

1. here: the doors gain the keyword and pass it by name to ``parse_loss_options``, which
   checks it, and it lands in a field: of ``LossSpec`` (``formulas``) when the math reads
   it, so every engine sees it as ``options.spec.foo``, else of ``LossOptions``. Either way
   :meth:`LossOptions.fields` puts it in the agreement by itself (the spec is one field; a
   new ``LossOptions`` field is one more of the agreement row's ``MAX_FIELDS`` = 16, of
   which the fused cross-entropy with a per-token temperature uses 15); a new per-token
   output is also one field of ``outputs.TokenOutputs`` and its place in
   :meth:`LossOptions.returned`;
2. ``formulas`` / ``grad``: its math on the shared statistics;
3. the kernels of each engine (``engines/triton_ops/tiles.py``); the torch engine and the
   materialized doors run the shared formulas as they are.

The agreement, the engine dispatch and the doors' bodies stay as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.checks import FrozenSpec, agree, check_choice, check_float
from mp_bridge.layers.loss.arguments import (
    check_ce_weight,
    check_fused_inputs,
    check_logits,
    check_options,
    check_reduction,
    check_shard,
    check_target,
    check_temperature,
)
from mp_bridge.layers.loss.class_weights import mean_scaled
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.outputs import TokenOutputs, counted_tokens, returned
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = ["KINDS", "PRECISIONS", "EngineChoice", "LossOptions", "parse_loss_options"]

#: ``"ce"``: cross-entropy (+ z-loss); ``"logprob"``: selected-token log-probs (+ entropy,
#: ``sum_pi_squared``); ``"entropy"``: the entropy alone (``target`` optional).
KINDS = ("ce", "logprob", "entropy")
PRECISIONS = ("fp32", "input")

#: ``(engine=, inputs' (name, shape, dtype), device, chunk_size) -> the engine that runs``
#: (the fused doors pass ``engines.protocol.choose_engine``: the options never import an
#: engine).
EngineChoice = Callable[
    [object, tuple[tuple[str, tuple[int, ...], torch.dtype], ...], torch.device, int | None],
    str,
]

#: Fields the ranks do not compare by value: ``inputs`` is spelled out per tensor, the
#: shard holds this rank's offset (its rank-independent part is in the shapes and the
#: spec), tensors are compared by their bits, and the group is what they compare over.
_NOT_BY_VALUE = ("inputs", "shard", "target", "token_temperature", "tp_group")
_AGREED_AS = {"chunk_size": "chunk"}


@dataclass(frozen=True, eq=False)
class LossOptions(FrozenSpec):
    """The validated options of one loss call: what the ranks agree on and an engine reads.

    ``kind``: one of ``KINDS``. ``spec``: the formula constants (``LossSpec``: vocab size,
    ``ignore_index``, label smoothing, the float temperature, soft-cap, z-loss weight,
    entropy, ``sum_pi_squared``, and ``class_weight``: the cross-entropy's ``ce_weight``
    ``[V]`` in the dtype the call computes in, scaled for "mean" by
    ``class_weights.mean_scaled``; the ranks agree on its bits). ``inputs``: ``(name, shape,
    dtype)`` of ``logits``, or of ``hidden`` and ``weight`` (its rows: ``shard.size``, every
    rank's, even where a ``DTensor``'s own are fewer), then of ``ce_weight`` when given (so
    an engine's ``unsupported`` sees it). ``shard``: this rank's ``VocabShard``
    (``start`` offset, ``num_real`` rows, true ``vocab_size``). ``target``: ``torch.long``
    ids of the token shape (``None`` only for an entropy without targets).
    ``token_temperature``: the per-token temperature, normalised once here
    (``token_temperature_of``): flat ``[N]``, contiguous, in the dtype the call computes in;
    or ``None`` (then the float ``spec.temperature``). ``engine``: the engine that runs,
    ``"torch"`` or ``"triton"`` (chosen at the parse by the fused doors' ``choose_engine``:
    ``"auto"`` resolved, an explicit one checked; always ``"torch"`` on the materialized
    doors). ``chunk_size`` (tokens whose logits exist at once, in every engine and mode;
    ``None``: the engine's default) and ``logits_precision`` are the fused doors' options.
    """

    kind: str
    spec: LossSpec
    inputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    shard: VocabShard
    target: torch.Tensor | None
    token_temperature: torch.Tensor | None
    reduction: str
    invariant: bool = False
    return_z_loss: bool = False
    tp_group: dist.ProcessGroup | None = None
    engine: str = "torch"
    chunk_size: int | None = None
    logits_precision: str = "fp32"

    @property
    def engine_reduction(self) -> str:
        """The reduction a fused engine applies: the call's own on the cross-entropy (under
        "sum" / "mean" the gradients can be made in forward), "none" on log-probs (the door
        reduces them with their extras, ``returned``)."""
        return self.reduction if self.kind == "ce" else "none"

    def fields(self) -> dict[str, object]:
        """What the ranks compare by value: each input's shape and dtype, then every field
        but those of ``_NOT_BY_VALUE`` (a new field joins by itself), ``chunk_size`` as
        ``chunk``."""
        out: dict[str, object] = {}
        for name, shape, dtype in self.inputs:
            out[f"{name}.shape"], out[f"{name}.dtype"] = shape, dtype
        for f in dataclasses.fields(self):
            if f.name not in _NOT_BY_VALUE:
                out[_AGREED_AS.get(f.name, f.name)] = getattr(self, f.name)
        return out

    def agree(
        self,
        where: str,
        *,
        device: torch.device,
        replicated: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """The TP ranks agree on this call, else the same ``AgreementError`` on every rank:
        :meth:`fields` equal, and ``target``, the per-token temperature and the
        ``replicated`` tensors (fused: ``hidden``) bit-identical. Under ``MP_BRIDGE_CHECK``,
        one tiny all-gather over ``tp_group`` (:func:`mp_bridge.checks.agree`); a rank that
        disagrees would otherwise hang or silently compute a wrong loss."""
        identical = {**(replicated or {}), "target": self.target}
        identical["temperature"] = self.token_temperature
        identical["ce_weight"] = self.spec.class_weight
        same = {k: t for k, t in identical.items() if t is not None}
        agree(where, self.tp_group, self, identical=same, device=device)

    def returned(self, out: TokenOutputs):
        """The requested outputs ``[...]`` of an engine's per-token ``out``, reduced by
        ``reduction``: one tensor or a tuple (see ``outputs``)."""
        counted = counted_tokens(self.target, self.spec.ignore_index)
        if self.kind == "entropy":
            return returned([out.entropy], counted, self.reduction)
        if self.kind == "logprob":
            return returned([out.value, out.entropy, out.sum_pi_squared], counted, self.reduction)
        z_loss = None
        if self.return_z_loss:
            z_loss = out.z_loss if out.z_loss is not None else torch.zeros_like(out.value.detach())
        return returned([out.value, z_loss], counted, self.reduction)


def token_temperature_of(temp: torch.Tensor, dtype: torch.dtype, fp32: bool) -> torch.Tensor:
    """The per-token temperature ``temp`` (broadcast to the token shape) as every engine
    takes it: flat ``[N]``, contiguous, in fp32, or with ``fp32=False`` (the materialized
    default path) in its accumulation dtype ``promote_types(dtype, fp32)`` (fp64 for fp64
    logits)."""
    acc = torch.float32 if fp32 else torch.promote_types(dtype, torch.float32)
    return temp.to(acc).reshape(-1).contiguous()


def _check_precision(logits_precision: object) -> str:
    return check_choice(
        "logits_precision",
        logits_precision,
        PRECISIONS,
        fix="'fp32': exact fp32-accumulated logits; 'input': logits rounded to the input dtype",
    )


def _spec(kind: str, vocab: int, target, extras: tuple[bool, bool], scalars) -> LossSpec:
    """The ``LossSpec`` of a ``kind`` call over ``vocab`` true classes; ``extras``: the
    log-probs' ``(return_entropy, return_sum_pi_squared)``."""
    softcap, zw, ignore_index, eps, temp, ce_weight = scalars
    if kind == "ce":
        return LossSpec.cross_entropy(
            vocab,
            ignore_index,
            eps,
            temperature=temp,
            softcap=softcap,
            z_loss_weight=zw,
            class_weight=ce_weight,
        )
    entropy = kind == "entropy"
    return LossSpec.logprob(
        vocab,
        temp,
        # no target: no id is ignored (the engine's placeholder ids own no column)
        ignore_index=None if target is None else ignore_index,
        softcap=softcap,
        entropy=entropy or extras[0],
        sum_pi_squared=not entropy and extras[1],
    )


def parse_loss_options(
    kind: str,
    *,
    target: torch.Tensor | None,
    tp_group: dist.ProcessGroup | None,
    vocab_size: int | None,
    reduction: str,
    ignore_index: int | None,
    softcap: float | None,
    temperature: float | torch.Tensor,
    invariant: bool,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    shard_rows: int | None = None,
    chunk_size: int | None = None,
    logits_precision: str = "fp32",
    engine: str = "auto",
    choose_engine: EngineChoice | None = None,
    label_smoothing: float = 0.0,
    ce_weight: torch.Tensor | None = None,
    z_loss_weight: float = 0.0,
    return_z_loss: bool = False,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
) -> LossOptions:
    """Validate one call of a ``kind`` loss (``KINDS``); return its options.

    The door's arguments by name: either ``logits``, or (fused) ``hidden``, ``weight``,
    ``chunk_size``, ``logits_precision``, ``engine`` and ``shard_rows``
    (``dtensor_weight.local_operands``: ``None``, or a ``DTensor`` weight's rows per rank,
    of which this rank's ``weight`` may hold fewer); ``target``, ``tp_group``,
    ``vocab_size``, ``reduction``, ``ignore_index``, ``softcap``, ``temperature``, on the
    cross-entropy ``label_smoothing``, ``z_loss_weight`` and ``ce_weight``; the bool
    options ``invariant`` and ``return_*`` (those the door has). ``choose_engine`` (the
    fused doors pass ``engines.protocol.choose_engine``): ``(engine, inputs, device) -> the
    engine that runs``, called here, so a bad choice, a missing ``triton`` or an input an
    explicit engine cannot run raises before any collective.
    """
    fused = hidden is not None
    if fused:
        like, rows = hidden, shard_rows  # a DTensor weight's rows per rank (dtensor_weight)
        check_fused_inputs(like, weight, chunk_size, rows)
        _check_precision(logits_precision)
        shard = check_shard(weight.shape[0] if rows is None else rows, vocab_size, tp_group)
        inputs = (("hidden", like), ("weight", weight))
        shape_of = f"the leading dims of hidden {tuple(like.shape)}: "
    else:
        like = logits
        shard = check_logits(like, tp_group, vocab_size)
        inputs = (("logits", like),)
        shape_of = f"logits shape {tuple(like.shape)} without the vocab dim "
    tokens = tuple(like.shape[:-1])
    eps = 0.0
    if kind == "ce":
        eps = check_float("label_smoothing", label_smoothing, low=0.0, high=1.0, open_low=False)
        ce_weight = check_ce_weight(ce_weight, shard.vocab_size, like)
    flags = dict(
        invariant=invariant,
        return_z_loss=return_z_loss,
        return_entropy=return_entropy,
        return_sum_pi_squared=return_sum_pi_squared,
    )
    softcap, zw, ignore_index = check_options(
        softcap=softcap, z_loss_weight=z_loss_weight, ignore_index=ignore_index, flags=flags
    )
    reduction = check_reduction(reduction)
    if target is not None:
        target = check_target(target, tokens, shard.vocab_size, ignore_index, shape_of=shape_of)
    temp = check_temperature(temperature, tokens, like, shape_of=shape_of)
    token_temp = None
    if isinstance(temp, torch.Tensor):
        token_temp = token_temperature_of(temp, like.dtype, fused or invariant)
    if ce_weight is not None:  # in the dtype the call computes in, like the temperature
        ce_weight = token_temperature_of(ce_weight, like.dtype, fused or invariant)
        if reduction == "mean" and target is not None:
            ce_weight = mean_scaled(ce_weight, target, ignore_index)
        inputs = (*inputs, ("ce_weight", ce_weight))
    scalars = (softcap, zw, ignore_index, eps, 1.0 if token_temp is not None else temp, ce_weight)
    described = tuple((name, tuple(t.shape), t.dtype) for name, t in inputs)
    if fused:  # the shard's rows, the same on every rank (a DTensor's may be short or empty)
        rows = (shard.size, weight.shape[1])
        described = tuple((n, rows if n == "weight" else s, d) for n, s, d in described)
    if not fused:
        engine = "torch"
    else:
        assert choose_engine is not None, "the fused doors pass engines.protocol.choose_engine"
        engine = choose_engine(engine, described, like.device, chunk_size)
    return LossOptions(
        kind,
        _spec(kind, shard.vocab_size, target, (return_entropy, return_sum_pi_squared), scalars),
        described,
        shard,
        target,
        token_temp,
        reduction,
        invariant=invariant,
        return_z_loss=return_z_loss,
        tp_group=tp_group,
        engine=engine,
        chunk_size=chunk_size if fused else None,
        logits_precision=logits_precision if fused else "fp32",
    )
