"""The one protocol of the fused-loss engines, what crosses it, and the dispatch.

The fused doors (``fused_linear_cross_entropy``, ``fused_linear_logprobs``) parse their
arguments into one ``LossOptions`` (``options``; the parse chooses the engine with
:func:`choose_engine`), get its engine (:func:`load_engine`), agree on the options over
TP, and make one call with the tokens flattened::

    engine.loss(hidden [N, H], weight [V_local, H], target [N], temperature [N] | None,
                options) -> TokenOutputs (outputs.py: one field per per-token output)

Layouts: ``hidden`` I@TP (identical bits on every rank of ``options.tp_group``),
``weight`` S(0)@TP (this rank's ``options.shard``: global vocab rows ``[shard.start,
shard.stop)``, rows ``>= shard.num_real`` are padding and never enter a softmax),
``target`` I@TP, outputs I@TP. See :class:`FusedLossEngine` for each argument and output.
Which engine runs is chosen by :func:`choose_engine` from the capabilities of
``registry.ENGINE_CAPS``; registering an engine: ``registry`` and ``engines/__init__.py``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mp_bridge.checks import check_choice
from mp_bridge.layers.loss.engines.registry import AUTO_ORDER, ENGINE_CAPS, ENGINES, engine_module
from mp_bridge.layers.loss.outputs import TokenOutputs

if TYPE_CHECKING:
    from mp_bridge.layers.loss.options import LossOptions

__all__ = ["FusedLossEngine", "choose_engine", "load_engine"]


@runtime_checkable
class FusedLossEngine(Protocol):
    """A fused LM-head loss engine: ``hidden @ weight.T`` -> per-token values, no logits
    tensor handed back, the weight never gathered.

    ``loss`` receives:

    - ``hidden [N, H]``: the tokens (leading dims flattened), the caller's float dtype and
      device, TP-replicated; may require grad.
    - ``weight [V_local, H]``: this rank's vocab shard, same dtype and device; may
      require grad (a frozen one gets no ``[V_local, H]`` gradient buffer). A ``DTensor``
      weight's shard (``dtensor_weight``: ``torch.chunk`` rows) holds only the real rows
      of ``options.shard``, ``V_local = shard.num_real <= shard.size``, possibly none:
      every choice that shapes a collective (chunks, tiles) is made from ``shard.size``.
    - ``target [N]``: ``torch.long`` ids in ``[0, spec.vocab_size)`` or
      ``spec.ignore_index``, TP-replicated; the owner of id ``t`` holds it at local row
      ``t - options.shard.start``.
    - ``temperature [N]``: the per-token fp32 temperature, flat and contiguous as the
      parse made it (``options.token_temperature``), or ``None`` (then the float
      ``options.spec.temperature``; ``LossSpec.temperatures`` gives it per row).
      Constant: no gradient flows to it.
    - ``options``: the agreed ``LossOptions``. An engine reads ``options.spec`` (the
      ``LossSpec`` of ``formulas``: every option the math reads, the per-token outputs it
      asks for among them; the math is in its docstring),
      ``options.shard`` (``VocabShard``), ``options.tp_group``,
      ``options.engine_reduction``, ``options.invariant``, ``options.chunk_size`` and
      ``options.logits_precision``. ``chunk_size`` has one meaning in every engine and
      mode: the number of tokens whose logits exist at once (``None``: the engine's
      default); an engine that rounds or caps it says how in its docstring, and one that
      cannot bound it declares so (``registry.EngineCaps.chunk_size``).

    It returns the per-token ``outputs.TokenOutputs`` (``lse`` ``None``): every field fp32
    on ``hidden``'s device, 0 at ``spec.ignore_index``; per token ``[N]``
    (``options.engine_reduction == "none"``), else the value and z-loss summed, or averaged
    over the counted tokens (nan when none counts, gradients 0). Gradients flow through the
    engine's own ``torch.autograd.Function`` (the torch engine: ``FusedLinearLoss`` in
    ``engines/torch_ops/driver.py``; a forward/backward kernel pair behind one Function is
    the same contract): its backward gives ``d hidden [N, H]`` whole (this rank's partial
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

    #: The registry name (``registry.ENGINE_CAPS``).
    name: str

    def unsupported(
        self, inputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    ) -> str | None:
        """Why this engine cannot run a call of these ``(name, shape, dtype)`` inputs
        (a shape limit, e.g. int32 offsets), or ``None``; its static capabilities are
        ``registry.ENGINE_CAPS``. An explicit choice then raises; ``"auto"`` picks
        another engine."""

    def loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        temperature: torch.Tensor | None,
        options: LossOptions,
    ) -> TokenOutputs:
        """The per-token outputs of one fused call (see the class docstring)."""


def choose_engine(
    asked: object,
    inputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
    device: torch.device,
    chunk_size: int | None = None,
) -> str:
    """The engine that runs a call: ``asked`` itself, or the choice of ``"auto"``.

    ``inputs``: ``(name, shape, dtype)`` of ``hidden`` and ``weight``; ``device``: theirs;
    ``chunk_size``: the call's (tokens whose logits exist at once; ``None``: the engine's
    default). Called by the parse (``options.parse_loss_options``), before any collective.

    - not one of ``ENGINES``: ``ValueError``;
    - explicit: it runs or raises, never falls back. A missing module is an
      ``ImportError`` (``registry.engine_module``); an input it cannot run (its
      ``ENGINE_CAPS``: device, dtype, a ``chunk_size`` it does not honour; or its
      ``unsupported`` shape check) a ``ValueError`` naming the reason;
    - ``"auto"``: the first of ``AUTO_ORDER`` whose ``auto_on`` holds the device type and
      that can run the call (a given ``chunk_size`` included); ``"torch"`` runs every
      call. A CUDA machine whose ``"triton"`` does not import warns (once per process
      under the default filter).
    """
    name = check_choice("engine", asked, ENGINES, fix="'auto': 'triton' on CUDA")
    dtypes = tuple(dtype for _, _, dtype in inputs)
    if name != "auto":
        engine = engine_module(name).ENGINE
        reason = ENGINE_CAPS[name].unsupported(device, dtypes) or engine.unsupported(inputs)
        if reason is None and chunk_size is not None and not ENGINE_CAPS[name].chunk_size:
            reason = f"chunk_size={chunk_size} (it does not bound the tokens it holds logits of)"
        if reason is not None:
            raise ValueError(
                f"engine={name!r} cannot run this call: {reason}; pass engine='auto' (it "
                "picks an engine that can) or engine='torch' (every input)"
            )
        return name
    for name in AUTO_ORDER:
        caps = ENGINE_CAPS[name]
        if caps.auto_on is not None and device.type not in caps.auto_on:
            continue
        if caps.unsupported(device, dtypes) is not None:
            continue
        if chunk_size is not None and not caps.chunk_size:
            continue
        try:
            engine = engine_module(name).ENGINE
        except ImportError as exc:
            # Issued from this one line, so the default filter shows it once per process.
            warnings.warn(
                f"engine='auto' runs the 'torch' engine on {device.type.upper()} tensors: {exc}",
                stacklevel=1,
            )
            continue
        if engine.unsupported(inputs) is None:
            return name
    return "torch"


def load_engine(options: LossOptions) -> FusedLossEngine:
    """The ``ENGINE`` of ``options.engine`` (chosen and imported by the parse)."""
    return engine_module(options.engine).ENGINE
