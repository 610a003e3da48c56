"""Loss engines behind one seam (issue 29): ``torch`` (the CPU reference) and ``triton``
(the GPU engine, ``engines.triton``; imported only when asked for)."""
