"""The engines behind the fused loss doors: one protocol, one registry, one package each.

- ``protocol.py``: ``FusedLossEngine`` (what an engine receives, how its gradients flow;
  it returns one ``outputs.TokenOutputs``), ``choose_engine`` (an explicit ``engine=``
  runs or raises; ``"auto"`` picks by the capabilities) and ``load_engine``;
- ``registry.py``: ``ENGINE_CAPS`` (name -> module and static capabilities: device types,
  dtypes, needed packages, where ``"auto"`` picks it), ``ENGINES`` (the choices of
  ``engine=``) and ``AUTO_ORDER``;
- ``torch_ops/``: the ``"torch"`` engine (chunked torch matmuls; the CPU path and the
  reference): ``engine`` and the runners of its two modes, ``default`` and
  ``invariant``, under the chunk driver ``driver``;
- ``triton_ops/``: the ``"triton"`` engine (GPU kernels; CPU tensors under
  ``TRITON_INTERPRET=1``), imported only when asked for or picked: ``triton_ops.engine`` and
  the runners ``triton_ops.default`` and ``triton_ops.invariant``, over one kernel per file.

The packages are not named ``torch`` / ``triton``: a tool that puts ``engines/`` on the
path would take them for the libraries.

Plugging in an engine ``NAME``: a package whose ``__init__`` exports ``ENGINE``, an
object with ``name = "NAME"``, ``unsupported(inputs)`` (its shape limits) and
``loss(hidden, weight, target, temperature, options)`` (``protocol``), and its row in
``registry.ENGINE_CAPS`` (and ``AUTO_ORDER`` for ``"auto"`` to try it). Nothing else
changes: the doors parse, choose, agree and dispatch through ``protocol``.

This ``__init__`` imports nothing, so importing one engine never imports another.
"""
