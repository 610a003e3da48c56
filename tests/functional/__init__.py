"""Functional tests: multi-rank cases run by ``DistributedWorld`` / ``run_distributed``.

Device contract: every case builds its tensors and modules on ``current_device()``
(``mp_bridge.testing``), the device the rank must use: the CPU under gloo by default,
``cuda:<rank>`` under NCCL, one GPU shared by every gloo rank in the one-GPU mode.

- Data: drawn from a seeded CPU ``torch.Generator()`` (the same values on every device)
  and moved with ``.to(current_device())`` right after drawing; generator-free factories
  (``zeros``, ``arange``, ``tensor``, ...) take ``device=``. A literal built for a
  comparison lives on the device of what it is compared with; results gathered across
  ranks as Python objects are compared on the CPU (``.cpu()`` first).
- Modules: ours, the single-process references (``ReferenceMimo``, ``ReferenceLLM``,
  ``torch.nn`` stand-ins) and megatron's (built on the CPU with
  ``use_cpu_initialization``) are moved with ``.to(current_device())`` or built with
  ``device=``; ``run_parity(device=current_device())`` moves its own.
- ``cu_seqlens`` of a ``MimoBatch`` stays on the CPU (``MimoBatch.to`` keeps it there:
  it steers slicing).
- A test that runs in the pytest process (no rank) must not touch CUDA: ranks forked
  afterwards could not start. Such tests check seeded data or argument parsing and say
  so in a comment. A case that cannot run on CUDA calls ``pytest.skip`` with its reason
  when ``current_device().type == "cuda"``; a file whose cases do not depend on the
  device (the launcher, the kit, fault injection, the CLI demo, the example) says why in
  its docstring.
"""
