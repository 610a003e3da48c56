"""The ``"torch"`` loss engine (``engine``): the runners of its two modes
(``default``, ``invariant``) under the chunk driver of ``driver``. Exports
``ENGINE``, as every engine package does (``registry``)."""

from mp_bridge.layers.loss.engines.torch_ops.engine import (
    DEFAULT_CHUNK_ELEMENTS,
    ENGINE,
    TorchEngine,
)

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ENGINE", "TorchEngine"]
