"""The ``"torch"`` loss engine (``torch_engine``): the runners of its two modes
(``torch_default``, ``torch_invariant``) under the chunk driver of ``driver``. Exports
``ENGINE``, as every engine package does (``registry``)."""

from mp_bridge.layers.loss.engines.torch_ops.torch_engine import (
    DEFAULT_CHUNK_ELEMENTS,
    ENGINE,
    TorchEngine,
)

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ENGINE", "TorchEngine"]
