"""The ``"torch"`` loss engine (``engine.py``): the chunk engines of ``chunks.py`` under the
driver of ``driver.py``. Exports ``ENGINE``, as every engine package does (``registry``)."""

from mp_bridge.layers.loss.engines.torch.engine import DEFAULT_CHUNK_ELEMENTS, ENGINE, TorchEngine

__all__ = ["DEFAULT_CHUNK_ELEMENTS", "ENGINE", "TorchEngine"]
