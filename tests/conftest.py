"""Project-wide test settings.

Hypothesis: no per-example deadline. These are correctness properties, not timing
checks, and a deadline turns a loaded 2-core CI machine into spurious failures (an
example of a 200 ms default deadline took 342 ms under load here).

``MP_BRIDGE_FAST=1`` (``make test-fast``) runs 20 examples per property instead of 100:
the quick loop while editing; the full count runs in ``make test`` and CI.

``TRITON_INTERPRET=1`` without CUDA: see below.
"""

import os

import torch
from hypothesis import settings

# The "triton" loss engine's tests (tests/triton_engine.py) run its kernels on CPU tensors
# under Triton's interpreter. Triton reads TRITON_INTERPRET when a function is decorated,
# its own @jit library (tl.zeros, ...) included, at `import triton` -- which
# megatron-core does early, even on CPU -- so it is set here, before any test module is
# imported, and only without CUDA: no CPU test runs any other Triton kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("mp_bridge", deadline=None)
settings.register_profile("mp_bridge_fast", deadline=None, max_examples=20)
settings.load_profile("mp_bridge_fast" if os.environ.get("MP_BRIDGE_FAST") == "1" else "mp_bridge")
