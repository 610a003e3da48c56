"""What Triton compiles for sm_90 (H100 / H200) from the triton engine's GEMM-like kernels
*as they are launched*, read on a machine without a GPU.

Each kernel with a ``tl.dot`` (``GEMM_KERNELS``) is launched through its own wrapper on
``meta`` tensors (no memory) with the kernel's ``run`` replaced by a recorder, so the
arguments, the grid and the launch options (``num_warps``, ``num_stages``,
``enable_fp_fusion``) are exactly the wrapper's. The arguments are then specialized as the
JIT specializes them at launch (``native_specialize_impl``: integers and pointers
divisible by 16 get ``tt.divisibility = 16``, an integer equal to 1 becomes a constant)
and compiled for ``GPUTarget("cuda", 90, 32)`` with the bundled ``ptxas``. Two builds per
kernel, dtype and call option:

- ``spec``: the production shape, chunk ``C = 1024`` tokens, ``H = 4096``, ``V_local =
  131072`` (the build that runs: vectorized loads, ``cp.async`` pipelining);
- ``odd``: ``C = 1023``, ``H = 4095`` (what a call with an odd ``N`` or ``H`` compiles).

The matrix (``MATRIX``): bf16 and fp32 (at its own tiles) in each of ``OPTIONS`` (mean
CE, ``ce_weight``, every RL option on, every CE option on: the options decide the
statistics and gradient kernels' constexprs, tiles and epilogues), fp16 in mean CE. A
build is keyed ``"<kernel> <dtype> <build>"`` in mean CE and ``"... <option>"`` otherwise.
Builds with the same kernel key (signature, constexprs, attributes, options) compile
once, the distinct ones in parallel over every CPU.

``facts`` reads from the PTX, the TTGIR, ``cuobjdump -res-usage`` and the SASS: the MMA
instructions (``wgmma.mma_async`` or ``mma.sync`` with their shapes), the pipelining
depth (shared-memory buffers of the k-loop's operands), registers, stack, ``LDL`` /
``STL``, shared memory and the CTAs per SM that registers and shared memory allow; and
the build's tile constexprs and ``k`` step.
``bench/gpu/compiled_facts.json`` records them per architecture (``--record`` rewrites
it); ``tests/unit/test_triton_compile.py`` compares a fresh compile with the record, and
``bench/gpu/roofline.py`` reads it. Run without ``TRITON_INTERPRET`` (under it the
kernels are interpreted functions with nothing to compile)::

    python -m tests.triton_facts            # JSON of the fresh facts
    python -m tests.triton_facts --record   # rewrite the record (then re-check bits on a GPU)
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from mp_bridge.layers.loss.engines.triton_ops import (
    block_dweight,
    block_grad,
    block_stats,
    dhidden,
)
from mp_bridge.layers.loss.formulas import LossSpec

ARCH = 90
RECORD = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "compiled_facts.json"
#: ``(name, C, H)``: the production chunk and an odd one (no divisibility specialization).
BUILDS = (("spec", 1024, 4096), ("odd", 1023, 4095))
V_LOCAL = 131072
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The calls whose options change a kernel's build (``block_stats`` / ``block_grad``):
#: mean cross-entropy (the benchmarked call, keyed without a suffix), with ``ce_weight``,
#: every RL option on (log-probs: per-token temperature, soft-cap, entropy,
#: ``sum_pi_squared``, ``ignore_index``) and every CE option on (soft-cap, z-loss, label
#: smoothing, ``ce_weight``).
OPTIONS = ("mean", "ce_weight", "rl", "ce")
#: ``(dtype, options)`` built in both ``BUILDS``: bf16 and fp32 (its own tiles) in every
#: option, fp16 (bf16's kernels with another MMA type) in mean CE.
MATRIX = (("bf16", OPTIONS), ("fp32", OPTIONS), ("fp16", ("mean",)))
#: sm_90 per SM: 64 Ki registers (allocated per warp in 256s), 228 KiB shared memory,
#: 2048 threads, 32 CTAs.
SM_REGS, SM_SMEM, SM_THREADS, SM_CTAS = 65536, 228 * 1024, 2048, 32
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def option_spec(option: str) -> tuple[LossSpec, bool]:
    """``(LossSpec, with class weights)`` of one of ``OPTIONS`` over ``V_LOCAL`` ids."""
    cw = torch.ones(V_LOCAL)
    return {
        "mean": (LossSpec.cross_entropy(V_LOCAL, -100, 0.0), False),
        "ce_weight": (LossSpec.cross_entropy(V_LOCAL, -100, 0.0, class_weight=cw), True),
        "rl": (
            LossSpec.logprob(
                V_LOCAL, 1.0, ignore_index=-100, softcap=30.0, entropy=True, sum_pi_squared=True
            ),
            False,
        ),
        "ce": (
            LossSpec.cross_entropy(
                V_LOCAL, -100, 0.1, softcap=30.0, z_loss_weight=1e-4, class_weight=cw
            ),
            True,
        ),
    }[option]


def _calls(dt: torch.dtype, c: int, hd: int, option: str = "mean"):
    """``(kernel, launching call)`` of every GEMM-like kernel at chunk ``c``, hidden ``hd``,
    for a call with ``option`` (``OPTIONS``; ``dhidden`` / ``block_dweight``: ``"mean"``
    only, their builds do not depend on it)."""
    spec, weighted = option_spec(option)
    k = V_LOCAL // 256

    def m(*shape, dtype=dt):
        return torch.empty(shape, dtype=dtype, device="meta")

    h, w, g = m(c, hd), m(V_LOCAL, hd), m(c, k * 256)
    f, t = m(c, dtype=torch.float32), m(c, dtype=torch.int64)
    colw = m(V_LOCAL, dtype=torch.float32) if weighted else None
    ent = f if spec.entropy else None
    yield (
        block_stats._block_stats_kernel,
        lambda: block_stats.block_stats(
            h, w, f, t, n_blocks=k, num_valid=V_LOCAL, spec=spec, colw=colw
        ),
    )
    yield (
        block_grad._block_grad_kernel,
        lambda: block_grad.block_grad(
            h,
            w,
            f,
            t,
            f,
            f,
            ent,
            ent,
            n_blocks=k,
            num_valid=V_LOCAL,
            spec=spec,
            colw=colw,
            wab=(f, f) if weighted else None,
        ),  # fmt: skip
    )
    if option != "mean":
        return
    yield (
        dhidden._dhidden_kernel,
        lambda: dhidden.dhidden(g, w, m(c, hd, dtype=torch.float32), k_rows=k * 256),
    )
    yield (
        block_dweight._block_dweight_kernel,
        lambda: block_dweight.block_dweight_(block_dweight.accumulator(V_LOCAL, hd, "meta"), g, h),
    )


#: The kernels ``_calls`` launches (every kernel of the engine with a ``tl.dot``).
GEMM_KERNELS = tuple(fn.__name__ for fn, _ in _calls(torch.bfloat16, 1, 1))


def launch_source(kernel, call) -> tuple[ASTSource, dict]:
    """``(ASTSource, compile options)`` of ``kernel`` as ``call`` launches it, specialized
    the way ``JITFunction.run`` specializes the arguments."""
    got = {}

    def record(*args, grid, warmup, **kw):
        got.update(args=args, kw=kw)

    kernel.run = record
    try:
        call()
    finally:
        del kernel.run
    kw = dict(got["kw"])
    values = dict(zip(kernel.arg_names, got["args"]))
    values.update({k: kw.pop(k) for k in list(kw) if k in kernel.arg_names})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
            continue
        ty, key = native_specialize_impl(
            BaseBackend, v, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
        )
        if ty == "constexpr":  # an integer equal to 1
            sig[p.name], consts[p.name] = "constexpr", key
            continue
        sig[p.name] = ty
        if isinstance(key, str):
            attrs[(i,)] = BaseBackend.parse_attr(key)
    return ASTSource(kernel, sig, consts, attrs), kw


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(_BIN / name), *args, f.name], capture_output=True, text=True)
    return out.stdout


def ctas_per_sm(regs: int, warps: int, shared: int) -> int:
    """CTAs one sm_90 SM holds by registers (per warp, in 256s), shared memory, threads."""
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = SM_REGS // (per_warp * warps) if regs else SM_CTAS
    by_smem = SM_SMEM // shared if shared else SM_CTAS
    return min(by_regs, by_smem, SM_THREADS // (32 * warps), SM_CTAS)


def facts(compiled, options: dict) -> dict:
    """The compiled facts of one kernel build (see the module docstring)."""
    ptx, ttgir, cubin = compiled.asm["ptx"], compiled.asm["ttgir"], compiled.asm["cubin"]
    mma = sorted(set(re.findall(r"\b(wgmma\.mma_async\.\S+|mma\.sync\.\S+)", ptx)))
    kind = "wgmma" if any(i.startswith("wgmma") for i in mma) else "mma.sync" if mma else "none"
    res = _tool("cuobjdump", cubin, "-res-usage")
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res))
    sass = _tool("cuobjdump", cubin, "-sass")
    # k-loop operand buffers: the leading dim of the 3-d shared allocations (2 = loads for
    # the next iteration in flight while this one computes; 1 or none: not pipelined)
    bufs = max((int(d) for d in re.findall(r"memdesc<(\d+)x\d+x\d+x", ttgir)), default=1)
    pipelined = bufs >= 2 and "cp.async" in ptx
    warps = compiled.metadata.num_warps
    shared = compiled.metadata.shared + int(usage.get("SHARED", 0))
    return {
        "mma": [re.sub(r"^(wgmma\.mma_async|mma\.sync)\.(sync\.)?aligned\.", "", i) for i in mma],
        "kind": kind,
        "tf32": "tf32" in ptx,
        "num_warps": warps,
        "num_stages": compiled.metadata.num_stages,
        "fp_fusion": compiled.metadata.enable_fp_fusion,
        "buffers": bufs,
        "cp_async": "cp.async" in ptx,
        # Triton's stages: loads issued num_stages - 1 iterations ahead (mma.sync: that
        # many buffers; wgmma: one more); 1 = the k-loop is not software-pipelined
        "stages": compiled.metadata.num_stages if pipelined else 1,
        "fma": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        "regs": int(usage["REG"]),
        "stack": int(usage["STACK"]),
        "ldl_stl": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "shared": shared,
        "ctas_per_sm": ctas_per_sm(int(usage["REG"]), warps, shared),
        "options": options,
    }


#: The tile constexprs a build records (``k_step``: the reduction step of its k-loop).
TILES = ("TILE_M", "BK", "BH", "BVW", "SPLIT", "APART")


def build_facts(compiled, src: ASTSource, options: dict) -> dict:
    """:func:`facts` plus the build's tiles and its k step (``BK``; ``block_dweight``,
    whose k-loop runs over tokens: ``TILE_M``)."""
    consts = {name: src.constants[(i,)] for i, name in enumerate(src.fn.arg_names)
              if (i,) in src.constants}  # fmt: skip
    tiles = {k: consts[k] for k in TILES if k in consts}
    k_step = tiles.get("BK", tiles.get("TILE_M"))
    return {**facts(compiled, options), "tiles": tiles, "k_step": k_step}


def build_keys() -> list[str]:
    """Every recorded build: ``"<kernel> <dtype> <build>"`` in mean CE, with ``" <option>"``
    for the others (``MATRIX``, ``BUILDS``)."""
    keys = []
    for dname, options in MATRIX:
        for build, c, hd in BUILDS:
            for option in options:
                for kernel, _ in _calls(DTYPES[dname], c, hd, option):
                    suffix = "" if option == "mean" else f" {option}"
                    keys.append(f"{kernel.__name__} {dname} {build}{suffix}")
    return keys


def _source_of(key: str) -> tuple[ASTSource, dict]:
    name, dname, build, *option = key.split()
    c, hd = {b: (c, hd) for b, c, hd in BUILDS}[build]
    for kernel, call in _calls(DTYPES[dname], c, hd, option[0] if option else "mean"):
        if kernel.__name__ == name:
            return launch_source(kernel, call)
    raise KeyError(key)


def _kernel_key(src: ASTSource, opts: dict) -> str:
    """What decides a compile: the kernel, its specialized signature, constexprs,
    attributes and options (two calls with the same key compile the same binary)."""
    return repr((src.fn.__name__, sorted(src.signature.items()), sorted(src.constants.items()),
                 sorted(src.attrs.items()), sorted(opts.items())))  # fmt: skip


def _compile(key: str) -> dict:
    src, opts = _source_of(key)
    compiled = triton.compile(src, target=GPUTarget("cuda", ARCH, 32), options=opts)
    return build_facts(compiled, src, opts)


def all_facts(workers: int | None = None) -> dict[str, dict]:
    """``{build key: facts}`` of every build of :func:`build_keys`, each distinct kernel
    key compiled once (e.g. ``block_stats`` with ``ce_weight`` and no smoothing is mean
    CE's build), in parallel over ``workers`` processes (default: every CPU)."""
    keys = build_keys()
    first: dict[str, str] = {}
    for key in keys:
        first.setdefault(_kernel_key(*_source_of(key)), key)
    unique = list(first.values())
    workers = workers or min(len(unique), os.cpu_count() or 1)
    if workers > 1:
        # spawn: a fork of this parent (torch's and Triton's threads) can hang on a lock
        from tests.triton_facts import _compile as compile_one  # by name, not __main__'s

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = dict(zip(unique, pool.map(compile_one, unique)))
    else:
        done = {key: _compile(key) for key in unique}
    return {key: done[first[_kernel_key(*_source_of(key))]] for key in keys}


def record_entry(found: dict[str, dict]) -> dict:
    return {"triton": triton.__version__, "builds": found}


def dump_record(data: dict) -> str:
    """The record's text: one line per build, so a diff shows what moved."""
    lines = ["{"]
    for i, (arch, entry) in enumerate(sorted(data.items())):
        lines.append(f' "{arch}": {{"triton": "{entry["triton"]}", "builds": {{')
        builds = sorted(entry["builds"].items())
        for j, (key, f) in enumerate(builds):
            comma = "," if j < len(builds) - 1 else ""
            lines.append(f"  {json.dumps(key)}: {json.dumps(f, sort_keys=True)}{comma}")
        lines.append(" }}" + ("," if i < len(data) - 1 else ""))
    return "\n".join([*lines, "}"]) + "\n"


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels do not compile")
    started = time.perf_counter()
    found = all_facts()
    took = time.perf_counter() - started
    print(f"{len(found)} builds in {took:.1f} s ({os.cpu_count()} CPUs)", file=sys.stderr)
    if "--record" in sys.argv:
        data = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        data[f"sm_{ARCH}"] = record_entry(found)
        RECORD.write_text(dump_record(data))
        print(f"recorded {len(found)} builds in {RECORD}")
    else:
        print(json.dumps(found, indent=1, sort_keys=True))
