"""The one protocol of the fused-loss engines, what crosses it, and the dispatch.

The fused doors (``fused_linear_cross_entropy``, ``fused_linear_logprobs``) parse their
arguments into one ``LossOptions`` (``options``), get its engine (:func:`load_engine`),
agree on the options over TP, and make one call with the tokens flattened::

    engine.loss(hidden [N, H], weight [V_local, H], target [N], temperature [N] | None,
                options) -> EngineOutput(values, extra, sum_pi_squared)

Layouts: ``hidden`` I@TP (identical bits on every rank of ``options.tp_group``),
``weight`` S(0)@TP (this rank's ``options.shard``: global vocab rows ``[shard.start,
shard.stop)``, rows ``>= shard.num_real`` are padding and never enter a softmax),
``target`` I@TP, outputs I@TP. See :class:`FusedLossEngine` for each argument and output.
Registering an engine: ``registry.ENGINE_MODULES`` and ``engines/__init__.py``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import torch

from mp_bridge.layers.loss.engines.registry import engine_module

if TYPE_CHECKING:
    from mp_bridge.layers.loss.options import LossOptions

__all__ = ["EngineOutput", "FusedLossEngine", "load_engine"]


class EngineOutput(NamedTuple):
    """What an engine returns; every tensor fp32 on ``hidden``'s device.

    ``values``: per token ``[N]`` (``options.engine_reduction == "none"``), else their
    0-dim sum, or mean over the counted tokens (nan when none counts, gradients 0); 0 at
    ``spec.ignore_index``. Differentiable.
    ``extra``: with ``spec.entropy`` the per-token entropy ``[N]`` (differentiable); else,
    with ``spec.z_loss_weight != 0``, the z-loss ``z_loss_weight * lse**2`` reduced like
    ``values`` (not differentiable: logging; its gradient is already in ``values``); else
    empty ``[0]``.
    ``sum_pi_squared``: with ``spec.sum_pi_squared`` (only asked with reduction "none"),
    ``sum_c p_c**2`` per token ``[N]`` (not differentiable); else empty ``[0]``.
    """

    values: torch.Tensor
    extra: torch.Tensor
    sum_pi_squared: torch.Tensor


@runtime_checkable
class FusedLossEngine(Protocol):
    """A fused LM-head loss engine: ``hidden @ weight.T`` -> per-token values, no logits
    tensor handed back, the weight never gathered.

    ``loss`` receives:

    - ``hidden [N, H]``: the tokens (leading dims flattened), the caller's float dtype and
      device, TP-replicated; may require grad.
    - ``weight [V_local, H]``: this rank's vocab shard, same dtype and device; may
      require grad (a frozen one gets no ``[V_local, H]`` gradient buffer).
    - ``target [N]``: ``torch.long`` ids in ``[0, spec.vocab_size)`` or
      ``spec.ignore_index``, TP-replicated; the owner of id ``t`` holds it at local row
      ``t - options.shard.start``.
    - ``temperature [N]``: the per-token fp32 temperature, or ``None`` (then the float
      ``options.spec.temperature``). Constant: no gradient flows to it.
    - ``options``: the agreed ``LossOptions``. An engine reads ``options.spec`` (the
      ``LossSpec`` of ``formulas``: kind ``"ce"`` / ``"logprob"``, ``vocab_size``,
      ``ignore_index``, ``label_smoothing``, ``temperature``, ``softcap``,
      ``z_loss_weight``, ``entropy``, ``sum_pi_squared``; the math is in its docstring),
      ``options.shard`` (``VocabShard``), ``options.tp_group``,
      ``options.engine_reduction``, ``options.invariant``, ``options.chunk_size``
      (``None``: the engine's default) and ``options.logits_precision``.

    It returns an :class:`EngineOutput`. Gradients flow through the engine's own
    ``torch.autograd.Function`` (the torch engine: ``FusedLinearLoss`` in
    ``engines/torch/driver.py``; a forward/backward kernel pair behind one Function is the
    same contract): its backward gives ``d hidden [N, H]`` whole (this rank's partial
    reduced over ``tp_group`` by the engine: the adjoint of the replicated input) in
    ``hidden.dtype``, and ``d weight [V_local, H]`` of this shard alone (no collective) in
    ``weight.dtype``, ``None`` for an input that needs none. It may make the gradients in
    forward (reductions "sum" / "mean") and only scale them in backward, and it refuses
    ``create_graph=True`` (``arguments.forbid_double_backward``).

    Collectives: over ``options.tp_group`` only, the same sequence on every rank (the
    options are agreed), small per-token statistics and ``d hidden``; at TP 1 none.
    ``options.invariant``: values and gradients bitwise identical for every TP size whose
    shard is whole ``VOCAB_BLOCK``-row blocks, any chunking, and whatever other tokens
    share the call, within this engine.
    """

    #: The registry name (``registry.ENGINE_MODULES``).
    name: str

    def unsupported(self, options: LossOptions) -> str | None:
        """The first option of ``options`` this engine cannot compute (its name, e.g.
        ``"label_smoothing"``), or ``None``. The door then runs the ``"torch"`` engine
        and warns once, naming it."""

    def loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        temperature: torch.Tensor | None,
        options: LossOptions,
    ) -> EngineOutput:
        """The per-token values and extras of one fused call (see the class docstring)."""


def load_engine(options: LossOptions) -> FusedLossEngine:
    """The ``ENGINE`` of ``options.engine`` (already imported by the parse), or the
    ``"torch"`` engine, with a warning, when it cannot compute one of the options. The
    choice depends on the agreed options alone, so every rank makes the same one."""
    engine = engine_module(options.engine).ENGINE
    missing = engine.unsupported(options)
    if missing is None:
        return engine
    # One line, one text per (engine, option): the default filter shows it once.
    warnings.warn(
        f"the {engine.name!r} engine cannot compute {missing!r} yet; this call runs the "
        "'torch' engine (same math, slower on GPUs)",
        stacklevel=1,
    )
    return engine_module("torch").ENGINE
