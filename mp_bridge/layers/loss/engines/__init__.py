"""The engines behind the fused loss doors: one protocol, one registry, one package each.

- ``protocol.py``: ``FusedLossEngine`` (what an engine receives and returns, how its
  gradients flow), ``EngineOutput`` and ``load_engine`` (the dispatch);
- ``registry.py``: ``ENGINES`` (the choices of ``engine=``), ``ENGINE_MODULES`` (name ->
  module) and ``resolve_engine`` (``"auto"``: ``"triton"`` for CUDA tensors, else
  ``"torch"``);
- ``torch/``: the ``"torch"`` engine (chunked torch matmuls; the CPU path and the
  reference);
- ``triton/``: the ``"triton"`` engine (GPU kernels), imported only when asked for or
  picked.

Plugging in an engine ``NAME``: a package ``engines/NAME/`` whose ``__init__`` exports
``ENGINE``, an object with ``name = "NAME"``, ``unsupported(options)`` and
``loss(hidden, weight, target, temperature, options)`` (``protocol``); its row in
``registry.ENGINE_MODULES`` and, for a new name, in ``registry.ENGINES``. Nothing else
changes: the doors parse, agree and dispatch through ``load_engine``.

This ``__init__`` imports nothing, so importing one engine never imports another.
"""
