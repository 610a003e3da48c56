"""Peak extra memory of the triton engine's default mode, *predicted* (no GPU measured it):
the tensors one call holds at each phase of forward + backward, from the code's sizes.

Extra memory is what ``bench/gpu/speed.py`` measures: ``max_memory_allocated`` during the
call minus ``memory_allocated`` before it, gradients included (``d W`` and ``d h`` in the
input dtype are the floor of any method). Phases of ``triton_default.TritonDefaultRunner``
(``Vs`` weight rows per slab, ``slab_rows``):

- forward, per slab: the fp32 logits ``z [N, Vs]`` (the ``[S, N]`` statistics are small);
- backward, allocated first: ``d W [V_local, H]`` in the weight's dtype and the fp32 ``d h``
  accumulator ``[N, H]``;
- ``row_grad``: ``z`` and ``g [N, Vs]`` in the input dtype (fp32 inputs: ``g`` is ``z``);
- ``d W_s``: ``g`` (``z`` freed); written straight into ``d W``'s rows (``mm_into_``; it was
  an fp32 ``[Vs, H]`` product and a copy: +``Vs H`` x 4 B, ``FP32_DW_PRODUCT``);
- ``d h += g W_s``: ``g`` (+ an fp32 ``[N, H]`` product where ``addmm`` lacks ``out_dtype``);
- the end: ``d W``, the fp32 ``d h`` and its copy in the input dtype.

The allocator's caching and cuBLAS's workspace (made in the warm-up call) are not counted.
"""

from __future__ import annotations

F32 = 4
GIB = 2**30
#: Issue 36's target at 8192 x 4096 x 131072 bf16 (Liger measured 1.13 GiB; floor 1.06).
DEFAULT_GIB = 1.25


def default_phases(
    n: int, h: int, v_local: int, elt: int, vs: int, fp32_dw_product: bool = False
) -> dict[str, int]:
    """Bytes held at each phase of one default-mode call (``elt``: bytes per input element;
    ``fp32_dw_product``: the code before ``mm_into_``, for comparison)."""
    z = n * vs * F32
    g = n * vs * elt  # fp32 inputs: row_grad writes g over z (one buffer)
    grads = v_local * h * elt + n * h * F32  # d W, fp32 d h accumulator
    return {
        "forward slab (z)": z,
        "row_grad (d W, d h acc, z, g)": grads + z + (0 if elt == F32 else g),
        "d W_s (d W, d h acc, g)": grads + g + (vs * h * F32 if fp32_dw_product else 0),
        "d h += g W_s (d W, d h acc, g)": grads + g,
        "end (d W, d h acc, d h)": grads + (0 if elt == F32 else n * h * elt),
    }


def default_peak(n: int, h: int, v_local: int, elt: int, vs: int, **kw) -> tuple[str, int]:
    """``(phase, bytes)`` of the largest phase."""
    phases = default_phases(n, h, v_local, elt, vs, **kw)
    return max(phases.items(), key=lambda kv: kv[1])


def floor_bytes(n: int, h: int, v_local: int, elt: int) -> int:
    """The two gradients in the input dtype: what any method returns."""
    return (v_local + n) * h * elt


def memory_lines(s, vs: int) -> tuple[str, list]:
    """The default mode's predicted peak at ``s`` (a roofline ``Shape``; ``vs`` rows per
    slab) as a line, and its target verdict at 8192 x 4096 x 131072 bf16, TP 1."""
    from report import Verdict

    args = (s.n, s.h, s.v_local, s.elt, vs)
    phase, peak = default_peak(*args)
    old = default_peak(*args, fp32_dw_product=True)[1]
    floor = floor_bytes(s.n, s.h, s.v_local, s.elt)
    tag = f"{s.n}x{s.h}x{s.v}, TP {s.tp}" + (" per rank" if s.tp > 1 else "")
    line = (
        f"- {tag}, {s.dtype}: default mode {peak / GIB:.3f} GiB at {phase} (with the old "
        f"fp32 d W_s product: {old / GIB:.3f}); floor, the two gradients: {floor / GIB:.3f}"
    )
    if (s.n, s.h, s.v, s.tp, s.dtype) != (8192, 4096, 131072, 1, "bf16"):
        return line, []
    target = f"predicted default peak GiB / {DEFAULT_GIB}, {tag}"
    return line, [Verdict(target, peak / GIB / DEFAULT_GIB, 1.0)]
