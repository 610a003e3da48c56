"""Peak extra memory of the triton engine's two modes, *predicted* (no GPU measured it):
the tensors one call holds at each phase of forward + backward, from the code's sizes.

Extra memory is what ``bench/gpu/speed.py`` measures: ``max_memory_allocated`` during the
call minus ``memory_allocated`` before it, gradients included (``d W`` and ``d h`` in the
input dtype are the floor of any method). Phases of ``triton_ops.default.TritonDefaultRunner``
(``Vs`` weight rows per slab, ``slab_rows``):

- forward, per slab: the fp32 logits ``z [N, Vs]`` (the ``[S, N]`` statistics are small);
- backward, allocated first: ``d W [V_local, H]`` in the weight's dtype and the fp32 ``d h``
  accumulator ``[N, H]``;
- ``row_grad``: ``z`` and ``g [N, Vs]`` in the input dtype (fp32 inputs: ``g`` is ``z``);
- ``d W_s``: ``g`` (``z`` freed); written straight into ``d W``'s rows (``mm_into_``; it was
  an fp32 ``[Vs, H]`` product and a copy: +``Vs H`` x 4 B, ``FP32_DW_PRODUCT``);
- ``d h += g W_s``: ``g`` (+ an fp32 ``[N, H]`` product where ``addmm`` lacks ``out_dtype``);
- the end: ``d W``, the fp32 ``d h`` and its copy in the input dtype.

Invariant mode (``triton_ops.invariant.TritonInvariantRunner``, chunks of ``C`` tokens):

- forward: the ``[S, K, G]`` fp32 block statistics of a fold group of ``G`` tokens (at
  TP > 1 the gathered ``[S, K_total, G]`` as well);
- backward, allocated first: the fp32 ``d h [N, H]`` and the fp32 ``d W`` accumulator
  ``[V_local, H]`` (one chunk, ``N <= C``: ``d W`` in the weight's dtype instead);
- per chunk (``C = 1024 max(TP, 8)`` tokens): ``g [C, V_local]`` in the input dtype; at
  TP > 1 (``d h`` by token-row ownership) the whole gathered weight ``[V, H]`` in the input
  dtype (held for the whole backward), the ``g`` rows this rank owns from every rank
  ``[C / TP, V]`` and its fp32 ``d h`` rows ``[C / TP, H]`` (the rows' all-gather writes
  straight into ``d h``);
- the end: the fp32 accumulator and its one rounding to ``d W`` in the weight's dtype, the
  fp32 ``d h`` and its copy in the input dtype.

The allocator's caching and cuBLAS's workspace (made in the warm-up call) are not counted.
"""

from __future__ import annotations

F32 = 4
GIB = 2**30
#: Issue 36's targets at 8192 x 4096 x 131072 bf16 (Liger measured 1.13 GiB; floor 1.06;
#: megatron-core's materialized path 6.0).
DEFAULT_GIB = 1.25
INVARIANT_GIB = 4.5
#: The invariant mode's sizes (``triton_ops.invariant``): chunk tokens, fold group, statistics
#: of a mean cross-entropy, vocab block.
CHUNK, FOLD_TOKENS, STATS, VOCAB_BLOCK = 1024, 8192, 4, 256


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


def invariant_phases(n: int, h: int, v: int, tp: int, elt: int) -> dict[str, int]:
    """Bytes held at each phase of one invariant-mode call (``v``: the whole vocab; each
    rank holds ``v / tp`` rows; chunks of ``CHUNK x max(tp, 8)`` tokens,
    ``default_chunk``)."""
    v_local, c, grp = v // tp, min(CHUNK * max(tp, 8), n), min(FOLD_TOKENS, n)
    k_local = -(-v_local // VOCAB_BLOCK)
    stats = STATS * k_local * grp * F32 + (STATS * k_local * tp * grp * F32 if tp > 1 else 0)
    # fp32 d h; d W: the fp32 accumulator, or (one chunk) d W itself in the input dtype
    acc = v_local * h * (F32 if n > c else elt)
    grads = n * h * F32 + acc
    chunk = c * v_local * elt
    if tp > 1:  # the gathered weight, this rank's g rows from every rank, its d h rows
        rows = -(-c // tp)
        chunk += v * h * elt + rows * v * elt + rows * h * F32
    end = grads + n * h * elt + (v_local * h * elt if n > c else 0)
    return {
        "forward (block statistics)": stats,
        "backward chunk (d h, d W, g)": grads + chunk,
        "end (d h, d W, d h copy)": end,
    }


def floor_bytes(n: int, h: int, v_local: int, elt: int) -> int:
    """The two gradients in the input dtype: what any method returns."""
    return (v_local + n) * h * elt


def memory_lines(s, vs: int) -> tuple[str, list]:
    """Both modes' predicted peaks at ``s`` (a roofline ``Shape``; ``vs`` rows per slab)
    as a line, and their target verdicts at 8192 x 4096 x 131072 bf16, TP 1."""
    from report import Verdict

    args = (s.n, s.h, s.v_local, s.elt, vs)
    phase, peak = default_peak(*args)
    old = default_peak(*args, fp32_dw_product=True)[1]
    floor = floor_bytes(s.n, s.h, s.v_local, s.elt)
    tag = f"{s.n}x{s.h}x{s.v}, TP {s.tp}" + (" per rank" if s.tp > 1 else "")
    inv_phase, inv = max(invariant_phases(s.n, s.h, s.v, s.tp, s.elt).items(), key=lambda kv: kv[1])
    line = (
        f"- {tag}, {s.dtype}: default mode {peak / GIB:.3f} GiB at {phase} (with the old "
        f"fp32 d W_s product: {old / GIB:.3f}); invariant mode {inv / GIB:.3f} GiB at "
        f"{inv_phase}; floor, the two gradients: {floor / GIB:.3f}"
    )
    if (s.n, s.h, s.v, s.tp, s.dtype) != (8192, 4096, 131072, 1, "bf16"):
        return line, []
    return line, [
        Verdict(
            f"predicted default peak GiB / {DEFAULT_GIB}, {tag}", peak / GIB / DEFAULT_GIB, 1.0
        ),
        Verdict(
            f"predicted invariant peak GiB / {INVARIANT_GIB}, {tag}", inv / GIB / INVARIANT_GIB, 1.0
        ),
    ]
