"""Project-wide test settings.

Hypothesis: no per-example deadline. These are correctness properties, not timing
checks, and a deadline turns a loaded 2-core CI machine into spurious failures (an
example of a 200 ms default deadline took 342 ms under load here).
"""

from hypothesis import settings

settings.register_profile("mp_bridge", deadline=None)
settings.load_profile("mp_bridge")
