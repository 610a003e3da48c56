"""Default mode (``invariant=False``): vocab-major slabs, cuBLAS GEMMs with fp32 output,
one Triton pass per slab for the statistics and one for the logits' gradient.

The shard's weight rows are cut into slabs of ``Vs`` rows (``slab_rows``: about
``SLAB_ELEMENTS`` fp32 logits, whole 256-row multiples). All ``N`` tokens meet each slab:

- forward: ``z = h @ W_s^T`` ``[N, Vs]`` fp32 (``mm_f32``), ``row_stats_`` merges the slab
  into the running ``[S, N]`` statistics; after the last slab, one all-gather merges the
  ranks' statistics (``reduce.gather_merge_stats``). 1 GEMM; ``lse`` (and the entropy)
  are kept for backward.
- backward: per slab, ``z`` again, ``row_grad`` writes ``g = d loss / d z`` in the input
  dtype, ``d W_s = g^T @ h`` is **complete** (every token is in it) and comes straight out
  of cuBLAS into ``d W``'s rows in the weight's dtype (``mm_into_``: fp32 accumulation, one
  rounding, no fp32 ``[Vs, H]`` product and copy), ``d h += g @ W_s`` in fp32
  (``addmm_f32_``); one all-reduce of ``d h``. 3 GEMMs.

``chunk_size`` (tokens whose logits exist at once; ``None``: all ``N``): the tokens go in
chunks of that many, each chunk through every slab, with one statistics all-gather and
one ``d h`` all-reduce per call whatever the chunking; ``d W`` then sums the chunks in an
fp32 buffer (``TritonDefaultRunner``). Without chunks, 4 GEMMs of ``N x V_local x H`` per
call, no ``[N, V_local]`` buffer, no fp32 copy of
the weight and no fp32 ``d W`` accumulator. Extra memory at ``N x H x V = 8192 x 4096 x
131072`` bf16, TP 1 (``Vs = 2048``), during the slab loop of backward: ``d W`` 1 GiB (bf16,
the gradient itself), ``d h``'s fp32 accumulator 128 MiB, and at ``row_grad`` (the peak)
the slab's ``z`` 64 MiB with ``g`` 32 MiB: 1248 MiB = 1.22 GiB (*predicted*,
``bench/gpu/roofline.py``; +128 MiB of fp32 ``d h`` product where ``addmm`` lacks
``out_dtype``). ``z`` is freed before the slab's ``d W_s``, which is written in place (it
was a 32 MiB fp32 product and a copy); the bf16 ``d h`` (64 MiB) is made after the slabs
are freed. The floor of any method is the two bf16 gradients, 1.06 GiB (issue 29
measured CCE there and Liger at 1.13 GiB on an H200); the fp32 ``d h`` accumulator is
most of our gap. Unmeasured on a GPU.

``mm_f32``: ``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA (bf16 / fp16 operands,
fp32 accumulate and output, never rounded to the input dtype); elsewhere ``a.float() @
b.float()`` of the same operands, the same exact products (a bf16 / fp16 product is exact
in fp32) summed in fp32: the stand-in that lets the CPU interpreter run this code path.
fp32 operands on CUDA go through cuBLAS inside ``exact_fp32``: never TF32, whatever the
caller set (``allow_tf32``, ``set_float32_matmul_precision``).

``mm_into_``: ``out = a @ b`` in ``out``'s dtype. On CUDA with bf16 / fp16 operands and an
output of their dtype, one cuBLAS GEMM: fp32 accumulation (``CUBLAS_COMPUTE_32F``), a
split-K reduction in fp32, one rounding to the output, inside ``exact_reduction`` (torch's
``allow_bf16/fp16_reduced_precision_reduction``, on by default, would let cuBLAS reduce
split-K partials in the output dtype; ``allow_fp16_accumulation`` would accumulate fp16 in
fp16). Elsewhere (CPU) the fp32 product of ``mm_f32`` copied into ``out``: the same one
rounding of an fp32 sum (only the summation order of the fp32 sum can differ, as between
any two GEMM libraries).

``addmm_path``: which product ``addmm_f32_`` uses on CUDA, checked once per process by a
tiny call (``ADDMM_OUT_DTYPE``, or ``MM_THEN_ADD`` with a warning naming the error where
this torch's ``addmm`` has no ``out_dtype``); the runbook prints it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mp_bridge.layers.loss.engines.triton_ops.row_grad import row_grad
from mp_bridge.layers.loss.engines.triton_ops.row_stats import row_stats_
from mp_bridge.layers.loss.engines.triton_ops.tiles import kernel_column_weights
from mp_bridge.layers.loss.formulas import LossSpec
from mp_bridge.layers.loss.reduce import all_reduce_sum_, gather_merge_stats
from mp_bridge.layers.vocab_shards import VocabShard

__all__ = [
    "ADDMM_OUT_DTYPE",
    "MM_THEN_ADD",
    "SLAB_ELEMENTS",
    "TritonDefaultRunner",
    "addmm_f32_",
    "addmm_path",
    "choose_addmm_path",
    "exact_fp32",
    "exact_reduction",
    "mm_f32",
    "mm_into_",
    "slab_rows",
]

#: fp32 logits per slab (64 MiB): slabs of 2048 rows at N = 8192, large enough GEMMs.
SLAB_ELEMENTS = 1 << 24


#: ``addmm_path`` values: cuBLAS accumulates into the fp32 ``acc`` itself, or (a torch
#: whose ``addmm`` lacks ``out_dtype``) an fp32 ``[N, H]`` product then ``add_``: +128 MiB
#: and about +7 ms at 8192 x 4096 x 131072 bf16 (predicted).
ADDMM_OUT_DTYPE = "addmm(out_dtype=float32, out=acc)"
MM_THEN_ADD = "mm(out_dtype=float32) + add_"


@contextlib.contextmanager
def _matmul_flags(values: dict[str, object], old: dict[str, object] | None = None):
    """``torch.backends.cuda.matmul``'s flags set to ``values`` inside, ``old`` (default:
    what they read now) restored after: the one set-and-restore behind ``exact_fp32`` and
    ``exact_reduction``."""
    mm = torch.backends.cuda.matmul
    old = {name: getattr(mm, name) for name in values} if old is None else old
    for name, value in values.items():
        setattr(mm, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(mm, name, value)


def exact_fp32():
    """cuBLAS fp32 matmuls in IEEE fp32 (no TF32) inside, the caller's setting restored
    after. Through ``fp32_precision`` where torch has it (the legacy ``allow_tf32`` and
    ``set_float32_matmul_precision`` map onto it; writing the legacy flag after a user set
    the new one is an error in torch >= 2.9), else through ``allow_tf32``."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return _matmul_flags({"fp32_precision": "ieee"})
    return _matmul_flags({"allow_tf32": False})


#: The operand dtypes whose cuBLAS GEMMs ``exact_reduction`` guards, and torch's flag name.
_REDUCTION_FLAG = {
    torch.bfloat16: "allow_bf16_reduced_precision_reduction",
    torch.float16: "allow_fp16_reduced_precision_reduction",
}


def exact_reduction(dtype: torch.dtype):
    """cuBLAS GEMMs of ``dtype`` (bf16 / fp16) operands accumulate *and* reduce split-K
    partials in fp32 inside, so a result in ``dtype`` is one rounding of an fp32 sum; the
    caller's settings restored after. Turns off torch's
    ``allow_{bf16,fp16}_reduced_precision_reduction`` (keeping its split-K switch) and,
    for fp16, ``allow_fp16_accumulation``. Other dtypes: nothing to guard."""
    mm = torch.backends.cuda.matmul
    name = _REDUCTION_FLAG.get(dtype)
    if name is None:
        return contextlib.nullcontext()
    try:  # a torch with the split-K switch: set and read as (reduced precision, split-K)
        old: dict[str, object] = {name: (getattr(mm, name), getattr(mm, f"{name}_split_k"))}
        values: dict[str, object] = {name: (False, old[name][1])}  # split-K kept
    except AttributeError:  # an older torch (one bool)
        old, values = {name: getattr(mm, name)}, {name: False}
    if dtype == torch.float16 and hasattr(torch._C, "_get_cublas_allow_fp16_accumulation"):
        old["allow_fp16_accumulation"] = mm.allow_fp16_accumulation
        values["allow_fp16_accumulation"] = False
    return _matmul_flags(values, old)


def choose_addmm_path(try_addmm: Callable[[], object]) -> str:
    """``ADDMM_OUT_DTYPE`` if ``try_addmm()`` runs, else ``MM_THEN_ADD`` with a warning
    naming the error (never silent)."""
    try:
        try_addmm()
    except (RuntimeError, TypeError) as exc:  # NotImplementedError is a RuntimeError
        warnings.warn(
            f"torch {torch.__version__}: addmm(out_dtype=float32) failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:120]}); the triton engine's default mode adds an fp32 "
            "d h product instead (more memory and time)",
            RuntimeWarning,
            stacklevel=3,
        )
        return MM_THEN_ADD
    return ADDMM_OUT_DTYPE


@functools.cache
def addmm_path(device_type: str = "cuda") -> str:
    """The product ``addmm_f32_`` uses for bf16 / fp16 operands on ``device_type``,
    checked once per process (CPU: fp32 operands, the interpreter's stand-in)."""
    if device_type != "cuda":
        return "addmm_ on fp32 operands (CPU stand-in)"

    def tiny():
        a = torch.ones((16, 16), dtype=torch.bfloat16, device=device_type)
        acc = torch.ones((16, 16), dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        if not bool((acc == 17.0).all()):
            raise AssertionError(f"addmm(out_dtype=float32, out=acc) gave {acc[0, 0].item()}")

    return choose_addmm_path(tiny)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (see the module docstring)."""
    if a.dtype == torch.float32:
        if a.is_cuda:
            with exact_fp32():
                return torch.mm(a, b)
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def mm_into_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b``, accumulated in fp32 and rounded once to ``out``'s dtype (see the
    module docstring); ``out`` is written in place (a contiguous block of rows)."""
    if a.is_cuda and out.dtype == a.dtype:
        ctx = exact_fp32() if a.dtype == torch.float32 else exact_reduction(a.dtype)
        with ctx:
            return torch.mm(a, b, out=out)
    return out.copy_(mm_f32(a, b))  # CPU stand-in (and mixed dtypes): fp32 sum, one rounding


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` into fp32 ``acc`` (``mm_f32``'s math; on CUDA cuBLAS accumulates into
    ``acc`` itself, no ``[N, H]`` fp32 product, where this torch has ``addmm``'s
    ``out_dtype``)."""
    if a.dtype == torch.float32:
        if a.is_cuda:
            with exact_fp32():
                return acc.addmm_(a, b)
        return acc.addmm_(a, b)
    if a.is_cuda:
        if addmm_path("cuda") == ADDMM_OUT_DTYPE:
            return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.add_(mm_f32(a, b))  # MM_THEN_ADD: addmm_path warned once
    return acc.addmm_(a.float(), b.float())


def slab_rows(n: int, v_local: int) -> int:
    """Weight rows per slab: ``SLAB_ELEMENTS / n`` rounded down to 256s, at least 256."""
    rows = max(256, SLAB_ELEMENTS // max(n, 1) // 256 * 256)
    return min(rows, max(v_local, 1))


@dataclass(frozen=True, eq=False)
class TritonDefaultRunner:
    """The default runner: ``stats`` (forward) and ``grads`` (backward) of one call.

    ``chunk``: tokens whose logits exist at once (``chunk_size``), or ``None``: all of
    them. With ``N > chunk`` the tokens go in chunks of ``chunk`` (the last shorter), each
    through every slab (``slab_rows`` of the chunk); forward merges the chunks' local
    statistics and makes the one all-gather after the last, backward accumulates ``d W``
    in an fp32 ``[V_local, H]`` buffer (one rounding at the end; +4 bytes per weight
    element) and makes the one ``d h`` all-reduce after the last chunk."""

    weight: torch.Tensor  # [V_local, H], this rank's shard
    tp_group: dist.ProcessGroup | None
    shard: VocabShard
    spec: LossSpec
    chunk: int | None = None

    def columns(self, target: torch.Tensor) -> torch.Tensor:
        """Local column of each target in this shard, else -1 (``int64 [N]``)."""
        inside = (target >= self.shard.start) & (target < self.shard.stop)
        return torch.where(inside, target - self.shard.start, -1).contiguous()

    def _chunks(self, n: int):
        step = n if self.chunk is None else self.chunk
        for s in range(0, n, max(step, 1)):
            yield slice(s, min(s + step, n))

    def _slabs(self, n: int):
        v, rows = self.weight.shape[0], slab_rows(n, self.weight.shape[0])
        for v0 in range(0, v, rows):
            yield v0, self.weight.detach()[v0 : v0 + rows]

    def stats(self, h: torch.Tensor, tcol: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        """Global ``[S, N]`` statistics (one all-gather over ``tp_group``)."""
        n = h.shape[0]
        stats = h.new_empty((self.spec.num_stats, n), dtype=torch.float32)
        if not self.weight.shape[0]:  # an empty shard (a DTensor's last): the merge identity
            stats.zero_()[0] = float("-inf")
        colw = kernel_column_weights(self.spec, self.shard.start, self.shard.num_real)
        for rows in self._chunks(n) if self.weight.shape[0] else ():
            part = stats if rows.stop - rows.start == n else torch.empty_like(stats[:, rows])
            for i, (v0, w_s) in enumerate(self._slabs(rows.stop - rows.start)):
                z = mm_f32(h[rows], w_s.t())  # (C, H) @ (H, Vs)
                row_stats_(
                    z, part, temp[rows], tcol[rows], num_valid=self.shard.num_real, col0=v0,
                    spec=self.spec, first=i == 0, colw=colw,
                )  # fmt: skip
                del z
            if part is not stats:
                stats[:, rows] = part
        return gather_merge_stats(stats, self.tp_group, self.spec.merge)

    def grads(self, h, tcol, temp, lse, w, w_ent, ent, want_gw: bool, wab=None):
        """``(d h [N, H] fp32, reduced over TP; d W [V_local, H] in the weight's dtype or
        None)`` for per-token factors ``w`` (and ``w_ent``; with class weights ``wab``,
        ``row_grad``'s)."""
        colw = None  # with wab only (class_weights: the rest runs unweighted)
        if wab is not None:
            colw = kernel_column_weights(self.spec, self.shard.start, self.shard.num_real)
        n = h.shape[0]
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        one = self.chunk is None or n <= self.chunk  # d W_s complete from one GEMM
        gw = acc = None
        if want_gw:
            gw = torch.empty_like(self.weight) if one else None
            acc = None if one else torch.zeros(self.weight.shape, dtype=torch.float32,
                                               device=h.device)  # fmt: skip
        for rows in self._chunks(n):
            hc = h[rows]
            w_ent_c = None if w_ent is None else w_ent[rows]
            ent_c = None if ent is None else ent[rows]
            wab_c = None if wab is None else (wab[0][rows], wab[1][rows])
            for v0, w_s in self._slabs(rows.stop - rows.start):
                z = mm_f32(hc, w_s.t())
                g = z if h.dtype == torch.float32 else torch.empty_like(z, dtype=h.dtype)
                row_grad(
                    z, g, temp[rows], tcol[rows], lse[rows], w[rows], w_ent_c, ent_c,
                    num_valid=self.shard.num_real, col0=v0, spec=self.spec, colw=colw,
                    wab=wab_c,
                )  # fmt: skip
                del z
                at = slice(v0, v0 + w_s.shape[0])
                if gw is not None:
                    mm_into_(gw[at], g.t(), hc)  # (Vs, N) @ (N, H): complete
                elif acc is not None:
                    addmm_f32_(acc[at], g.t(), hc)  # (Vs, C) @ (C, H), summed over chunks
                addmm_f32_(gh[rows], g, w_s)  # (C, Vs) @ (Vs, H)
        if acc is not None:
            gw = acc.to(self.weight.dtype)  # one rounding of the fp32 sum
        return all_reduce_sum_(gh, self.tp_group), gw
