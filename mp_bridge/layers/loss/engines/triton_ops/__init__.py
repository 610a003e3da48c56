"""The ``"triton"`` loss engine: fused LM-head cross-entropy / log-probs on the GPU.

Two modes over a vocab shard at any TP, every option of the torch engine in the kernels:

- default (``triton_ops.default``): cuBLAS ``out_dtype=fp32`` GEMMs over vocab slabs, one Triton
  statistics pass and one gradient pass per slab; 4 GEMMs, no fp32 weight or ``d W``.
- ``invariant=True`` (``triton_ops.invariant``): fixed-tile Triton kernels over 256-row vocab blocks
  (statistics folded in the canonical block tree, ``d h`` by token-row ownership over
  the whole vocab); bitwise identical across TP sizes, chunkings and batch composition.

One kernel per file with its launch wrapper and tile sizes at the top (``row_stats``,
``row_grad``, ``block_stats``, ``fold_stats``, ``block_grad``, ``dhidden``,
``block_dweight``), the shared math in ``tiles``; ``ENGINE`` (``triton_ops.engine``) is the
``FusedLossEngine`` the registry loads. Importing this package imports ``triton``: the
registry imports it only when ``engine="triton"`` is asked for (or picked by ``"auto"``).
Under ``TRITON_INTERPRET=1`` (set before this import) the kernels run on CPU tensors.
"""

from mp_bridge.layers.loss.engines.triton_ops.engine import ENGINE, TritonEngine

__all__ = ["ENGINE", "TritonEngine"]
