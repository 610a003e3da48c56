"""Put mp_bridge's :class:`ColocatedBridgeCommunicator` inside megatron-core's ``MimoModel``.

megatron-core >= 0.18 builds one ``ColocatedBridgeCommunicator`` per colocated encoder in
``MimoModel.__init__`` (``megatron.core.models.mimo.model.base``) with the keywords
``src_grid, dest_grid, src_module_name, dest_module_name, dim_mapping={'b': 0, 'h': 1}``
and later calls only ``communicate(x)`` (forward) and ``destroy()`` (``MimoModel.destroy``).
Ours takes the same keywords and offers both with the same semantics (same forward values
and gradients on every layout both accept), and adds: dest CP > 1 (the CP all-reduce in
backward), any backend (megatron's hard-codes ``backend='nccl'`` for its gather groups, so
it cannot run on CPU), the check that the two DP layouts nest (megatron's gives wrong
values on a non-nesting pair) and outputs the LLM may modify in place.

One call, before the model is built, on every rank::

    from mp_bridge.integrations.megatron import patch_mimo_model

    patch_mimo_model()                     # every MimoModel built from now on uses ours
    model = MimoModel(mimo_config, cp_group=..., tp_group=...)

or scoped: ``with patch_mimo_model(): model = MimoModel(...)`` (the communicators built
inside keep working after the block; only later constructions are back to megatron's).

Importing this module imports nothing from megatron; ``patch_mimo_model`` imports
megatron's MIMO stack when called.
"""

from __future__ import annotations

from typing import Any

from mp_bridge.comm.bridge.execution.communicator import ColocatedBridgeCommunicator
from mp_bridge.grid.megatron_compat import MIMO_COMMUNICATOR_MODULE, mimo_model_module

__all__ = ["MimoModelPatch", "patch_mimo_model"]

_NAME = "ColocatedBridgeCommunicator"


class MimoModelPatch:
    """Handle returned by :func:`patch_mimo_model`: ``undo()`` or use as a context manager."""

    def __init__(self, module: Any, previous: Any) -> None:
        self._module = module
        self._previous = previous
        self._active = True

    @property
    def active(self) -> bool:
        return self._active

    def undo(self) -> None:
        """Restore the communicator class that was there before (idempotent)."""
        if self._active:
            setattr(self._module, _NAME, self._previous)
            self._active = False

    def __enter__(self) -> MimoModelPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"MimoModelPatch({MIMO_COMMUNICATOR_MODULE}.{_NAME}, {state})"


def patch_mimo_model() -> MimoModelPatch:
    """Make every megatron-core ``MimoModel`` built afterwards use mp_bridge's communicator.

    Replaces the ``ColocatedBridgeCommunicator`` name that ``MimoModel`` constructs in
    ``megatron.core.models.mimo.model.base`` with
    :class:`mp_bridge.comm.ColocatedBridgeCommunicator` (the same for every colocated
    encoder; ``model.colocated_comms`` then holds ours). Call it on every rank, before
    ``MimoModel(...)``; models built earlier keep megatron's. Process-local, no collective.
    Calling it again while active is harmless; nested handles undo in reverse order.

    Raises ``RuntimeError`` (naming the installed version) when the installed megatron-core
    has no such communicator (< 0.18).
    """
    module = mimo_model_module()
    return MimoModelPatch(module, _swap(module))


def _swap(module: Any) -> Any:
    previous = getattr(module, _NAME)
    setattr(module, _NAME, ColocatedBridgeCommunicator)
    return previous
