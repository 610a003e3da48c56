"""Roofline model of the triton LM-head engine on an H200, *predicted* (no GPU measured it):
every kernel of both modes, mean cross-entropy forward + backward, bf16 (``--dtype fp32``:
fp32 inputs, no tensor cores, no TF32).

For each kernel at ``N x H x V`` (TP 1, or one rank's share at TP 8: ``V_local = V / 8``):

- FLOPs: ``2 N V_local H`` per GEMM-like pass;
- HBM bytes from the grid order, with an L2 of ``L2_BYTES`` (50 MB): an operand tile whose
  users run next to each other in launch order is read once; one whose users are a grid
  row apart is read once if the bytes the grid touches in between fit in L2, else once per
  user group (``reads``). Outputs are written once. Programs in flight at once: ``SMS x``
  the CTAs per SM of the compiled build;
- L2 -> SM bytes (Triton kernels): every program streams its operand tiles, no reuse
  between programs counted; for cuBLAS passes this traffic is inside the measured rate;
- the compiled facts (``bench/gpu/compiled_facts.json``, ``tests/triton_facts.py``): MMA
  kind, pipelining stages, CTAs per SM; the kind picks the rate;
- zero-fills (``torch.zeros`` of an fp32 accumulator) as kernels: their bytes written;
- at TP > 1, every collective as time: the bytes each rank receives at ``comm_model.LINK_BPS``
  (350 GB/s over NVLink, assumed), placed in the code's own order against the kernels
  (``comm_model.SCHEDULES``): overlapped only where the code issues it ``async_op`` and
  waits later; the totals are that timeline's (compute + exposed communication).

Fixed rates (so the model cannot be tuned to the target): cuBLAS ``RATE_CUBLAS_BF16`` /
``RATE_CUBLAS_F32OUT`` TFLOP/s, measured for this project on an H200 (torch 2.11); Triton
wgmma kernels exactly 80 % of cuBLAS bf16, ``mma.sync`` kernels exactly 45 %; HBM 4.8 TB/s x
85 %; L2 -> SM 7 TB/s. A kernel takes the longest of its compute, HBM and L2 times; one
whose launches hold fewer programs than there are SMs runs compute and L2 at that share of
the rates (``Kernel.busy``: ``dhidden``, whose grid is ``C / 128 x H / (256 TP)``). The
invariant mode's statistics fold (``fold_stats``, one small launch per ``FOLD_TOKENS``)
takes ``LAUNCH_S`` per launch plus its HBM time; fp32 inputs: cuBLAS
SGEMM at ``RATE_CUBLAS_FP32`` and Triton's FMA ``tl.dot`` at 45 % of it (both stated here,
not in the issue's list). New kernels are a new entry in ``MODES``; the default mode's
peak extra memory: ``memory_model.py``.

    python bench/gpu/roofline.py                 # the table of bench/RESULTS.md
    python bench/gpu/roofline.py --vocab 131072 --tp 1 --dtype fp32
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FACTS = Path(__file__).resolve().parent / "compiled_facts.json"
ARCH = "sm_90"
DEVICE = "NVIDIA H200 (SXM, 132 SMs, 50 MB L2, 4.8 TB/s HBM3e)"
SMS = 132
L2_BYTES = 50e6
RATE_CUBLAS_BF16 = 786e12  # FLOP/s, bf16 out (measured for this project, H200, torch 2.11)
RATE_CUBLAS_F32OUT = 755e12  # FLOP/s, out_dtype=float32 (same source)
RATE_CUBLAS_FP32 = 0.80 * 67e12  # IEEE fp32 SGEMM: datasheet fp32 (CUDA cores) x 80 %, assumed
RATE = {
    "cublas_bf16": RATE_CUBLAS_BF16,
    "cublas_f32out": RATE_CUBLAS_F32OUT,
    "cublas_fp32": RATE_CUBLAS_FP32,
    "wgmma": 0.80 * RATE_CUBLAS_BF16,
    "mma.sync": 0.45 * RATE_CUBLAS_BF16,
    "fma": 0.45 * RATE_CUBLAS_FP32,  # Triton's fp32 tl.dot: FMA, no tensor core (assumed)
}
HBM_BPS = 4.8e12 * 0.85
L2_BPS = 7e12
LAUNCH_S = 4e-6  # one small launch (host-bound): the statistics fold's fixed cost
BF16 = 2
F32 = 4
#: Issue 36's time targets: invariant <= 1.25 x default (TP 1 and per rank at TP 8), and
#: default <= 52 ms at 8192 x 4096 x 131072 (0.95 x Liger's 54.6 ms measured so far).
#: Issue 42's: invariant / default <= 1.3 at TP 1 and <= 1.5 per rank at TP 8, the
#: collectives counted.
INVARIANT_LIMIT = 1.25
LIMIT_42 = {1: 1.3, 8: 1.5}
LOGPROB_LIMIT = 1.5  # log-probs with a per-token upstream gradient
DEFAULT_MS = 52.0
#: The default mode's and the invariant mode's tiles (the code's constants; the facts
#: file is keyed by kernel name).
SLAB_ELEMENTS = 1 << 24  # triton_ops.default.SLAB_ELEMENTS
VOCAB_BLOCK = 256  # blocks.VOCAB_BLOCK
TILE_M = 128  # block_stats.TILE_M
TILE_M_FP32 = 32  # block_stats.TILE_M_FP32: every fp32 row tile (row_tile)
#: Token rows per program of each logits kernel in the running (16-divisible) build
ROW_TILE = {"_block_stats_kernel": TILE_M, "_block_grad_kernel": 128}  # block_grad.WIDE_M
BVW, BHW, TILE_K, GROUP_V = 128, 256, 64, 8  # block_dweight.BVW, .BH (bf16 / fp16), .TILE_K
BVW_FP32 = BHW_FP32 = 64  # block_dweight.BVW_FP32, .BH_FP32
CHUNK = 1024  # triton_ops.invariant.DEFAULT_CHUNK_TOKENS: times max(TP, 8) (``chunk``)
FOLD_TOKENS = 8192  # triton_ops.invariant.FOLD_TOKENS: tokens folded at once (whole chunks)
STATS = 4  # S: (m, s, target, sum z) for plain cross-entropy
LINK_BPS_TEXT = "350 GB/s (comm_model.LINK_BPS)"


@dataclass(frozen=True)
class Shape:
    n: int
    h: int
    v: int  # the whole vocab
    tp: int = 1
    dtype: str = "bf16"  # or "fp32" (the facts file's names)

    @property
    def v_local(self) -> int:
        return self.v // self.tp

    @property
    def elt(self) -> int:
        """Bytes of one input / gradient element."""
        return F32 if self.dtype == "fp32" else BF16


@dataclass(frozen=True)
class Kernel:
    """One kernel's work over a whole call (all slabs / chunks) and how it is bound."""

    mode: str
    name: str
    kind: str  # a RATE key, "memory" (element-wise) or "launches"
    flops: float = 0.0
    hbm: float = 0.0  # bytes
    l2: float = 0.0  # bytes, L2 -> SM (Triton kernels only)
    launches: int = 0  # host-bound torch launches ("launches" kind)
    facts: str = "element-wise"
    busy: float = 1.0  # share of the SMs its launches keep busy (scales compute and L2)

    @property
    def times(self) -> dict[str, float]:
        return {
            "compute": self.flops / (RATE[self.kind] * self.busy) if self.kind in RATE else 0.0,
            "hbm": self.hbm / HBM_BPS,
            "l2": self.l2 / (L2_BPS * self.busy),
            "launch": self.launches * LAUNCH_S,
        }

    @property
    def seconds(self) -> float:
        return max(self.times.values())

    @property
    def bound(self) -> str:
        t = self.times
        return max(t, key=t.get)


def load_facts(path: Path = FACTS) -> dict[str, dict]:
    return json.loads(path.read_text())[ARCH]["builds"]


def _fact(facts, name: str, dtype: str = "bf16") -> dict:
    return facts[f"{name} {dtype} spec"]


def _triton_kind(f: dict) -> str:
    return {"wgmma": "wgmma", "mma.sync": "mma.sync", "none": "fma"}[f["kind"]]


def _facts_text(f: dict) -> str:
    mma = f"{f['kind']} {f['mma'][0].split('.')[0]}" if f["mma"] else "FMA dot (no MMA)"
    return f"{mma}, {f['stages']} st, {f['ctas_per_sm']} CTA/SM"


def fits(touched: float) -> bool:
    """Whether ``touched`` bytes between two uses of a tile leave it in L2."""
    return touched <= L2_BYTES


# --- default mode: triton_ops.default (cuBLAS over slabs of Vs rows; row_stats / row_grad) -------


def slab_rows(n: int, v_local: int) -> int:
    return min(max(256, SLAB_ELEMENTS // max(n, 1) // 256 * 256), v_local)


def _gemm_slabs(
    s: Shape, name: str, kind: str, extra_per_slab: float, reads_h: bool = True
) -> Kernel:
    """A cuBLAS pass over the slabs: the weight read once, ``h`` (N x H, where it is an
    operand) re-read per slab unless it fits in L2 with a slab, ``extra_per_slab`` bytes of
    ``g`` / fp32 output / accumulator traffic."""
    vs = slab_rows(s.n, s.v_local)
    slabs = math.ceil(s.v_local / vs)
    h_bytes = s.n * s.h * s.elt if reads_h else 0
    hbm = h_bytes * (1 if fits(h_bytes + vs * s.h * s.elt) else slabs)
    hbm += s.v_local * s.h * s.elt + slabs * extra_per_slab
    return Kernel("default", name, kind, 2.0 * s.n * s.v_local * s.h, hbm, facts="cuBLAS")


def default_mode(s: Shape, facts) -> list[Kernel]:
    """bf16: z in fp32, ``d W_s`` straight into ``d W``'s bf16 rows (``mm_into_``: no fp32
    product, no copy); fp32: every GEMM an IEEE SGEMM, ``g`` written over ``z``."""
    vs = slab_rows(s.n, s.v_local)
    z = s.n * vs * F32  # one slab's fp32 logits
    g = s.n * vs * s.elt  # its gradient in the input dtype
    slabs = math.ceil(s.v_local / vs)
    f32 = s.dtype == "fp32"
    zk, wk = ("cublas_fp32",) * 2 if f32 else ("cublas_f32out", "cublas_bf16")
    zn = "(mm, IEEE fp32)" if f32 else "(mm out_dtype=fp32)"
    dh = f"bwd: dh += g W_s (addmm{'' if f32 else ' out_dtype=fp32'})"
    grad = Kernel("default", f"bwd: row_grad (z -> g {s.dtype})", "memory", hbm=slabs * (z + g))
    zero = Kernel("default", "bwd: zero-fill fp32 d h acc (torch.zeros)", "memory",
                  hbm=s.n * s.h * F32, facts="torch fill")  # fmt: skip
    return [
        _gemm_slabs(s, f"fwd: z = h W_s^T {zn}", zk, z),
        Kernel("default", "fwd: row_stats", "memory", hbm=slabs * z),
        zero,
        _gemm_slabs(s, f"bwd: z again {zn}", zk, z),
        grad,
        _gemm_slabs(s, f"bwd: dW_s = g^T h (mm, {s.dtype} out)", wk, g + vs * s.h * s.elt),
        _gemm_slabs(s, dh, zk, g + 2 * s.n * s.h * F32, reads_h=False),  # g; fp32 acc in, out
    ]


# --- invariant mode: triton_ops.invariant (fixed Triton tiles over 256-row blocks, chunks of C)


def _window(f: dict) -> int:
    """Programs in flight at once."""
    return SMS * f["ctas_per_sm"]


def block_logits_pass(s: Shape, facts, name: str, label: str, out_bytes: float) -> Kernel:
    """``block_stats`` / ``block_grad``: grid ``(C / TILE_M, K)``, token tiles fastest;
    each program streams its ``[TILE_M, H]`` hidden tile and ``[256, H]`` weight block."""
    f = _fact(facts, name, s.dtype)
    tm = TILE_M_FP32 if s.dtype == "fp32" else ROW_TILE[name]
    c, k = chunk(s), s.v_local // VOCAB_BLOCK
    chunks = math.ceil(s.n / c)
    programs = chunks * math.ceil(c / tm) * k
    w_block = VOCAB_BLOCK * s.h * s.elt
    h_chunk = c * s.h * s.elt
    # W block j: its C / tm users are consecutive -> once per chunk; the hidden chunk
    # is reused one grid row (C / tm programs) later, touching itself + one block
    h_reads = 1 if fits(h_chunk + w_block) else k
    hbm = chunks * (s.v_local * s.h * s.elt + h_reads * h_chunk) + out_bytes
    l2 = programs * (tm + VOCAB_BLOCK) * s.h * s.elt
    return Kernel("invariant", label, _triton_kind(f), 2.0 * s.n * s.v_local * s.h, hbm, l2,
                  facts=_facts_text(f))  # fmt: skip


#: ``dhidden``'s tiles: ``(TILE_M, BH, BK)`` per dtype (dhidden.TILE_M / .BH / .BK, _FP32)
DH_TILE = {"bf16": (128, 256, 64), "fp32": (32, 64, 32)}


def dhidden_pass(s: Shape, facts) -> Kernel:
    """``d h`` by token-row ownership: ``d h[rows_r] = g_full[rows_r] @ W_full``, one plain
    GEMM over the whole vocab per chunk (TP 1: every row, the shard; TP > 1: rank 0's
    ``ceil(C / TP)`` rows, the most, and the whole gathered weight). Grid ``(Cr / TILE_M,
    H / BH)``, token tiles fastest; each program streams ``g [TILE_M, BK]`` and ``W [BK,
    BH]`` per ``k`` step over all ``V`` rows. ``W[:, c-slice]``'s users are consecutive:
    once per chunk; the ``g`` rows are reused by the ``H / BH`` programs of a tile row,
    ``Cr / TILE_M`` apart: the ones in flight together share a read. A launch of fewer
    programs than SMs leaves SMs idle: ``busy`` scales the compute and L2 rates."""
    f = _fact(facts, "_dhidden_kernel", s.dtype)
    tm, bh, bk = DH_TILE[s.dtype]
    c = chunk(s)
    cr = math.ceil(c / s.tp)  # token rows a rank owns per chunk
    chunks = math.ceil(s.n / c)
    tiles, cols = math.ceil(cr / tm), math.ceil(s.h / bh)
    programs = chunks * tiles * cols
    g_reads = math.ceil(cols / max(1, _window(f) // tiles))
    hbm = chunks * (g_reads * cr * s.v * s.elt + s.v * s.h * s.elt + cr * s.h * F32)
    l2 = programs * math.ceil(s.v / bk) * (tm * bk + bk * bh) * s.elt
    busy = min(1.0, tiles * cols / SMS)  # programs of one launch (a chunk) over the SMs
    return Kernel("invariant", "bwd: dhidden (g rows_r W_full, token-row ownership)",
                  _triton_kind(f), 2.0 * chunks * cr * s.v * s.h, hbm, l2,
                  facts=_facts_text(f), busy=busy)  # fmt: skip


def block_dweight_pass(s: Shape, facts) -> Kernel:
    """``H / BHW x R / BVW`` programs in groups of ``GROUP_V`` vocab tiles (vocab tiles
    fastest inside a group, then the hidden tiles); each program loads its fp32
    ``[BVW, BHW]`` accumulator, adds ``g^T h`` over the chunk's ``TILE_K``-token steps
    (one ``[BVW, TILE_K]`` ``g^T`` tile and ``[TILE_K, BHW]`` of ``h`` per step), stores
    it: the fp32 ``[R, H]`` accumulator passes once in and once out per chunk, in HBM and
    through L2 to the SMs. A single chunk (``N <= CHUNK``) starts from zero and writes ``d
    W`` in the input dtype: no accumulator traffic."""
    f = _fact(facts, "_block_dweight_kernel", s.dtype)
    bvw, bhw = (BVW_FP32, BHW_FP32) if s.dtype == "fp32" else (BVW, BHW)
    c = chunk(s)
    chunks = math.ceil(s.n / c)
    rows, cols = math.ceil(s.v_local / bvw), math.ceil(s.h / bhw)
    programs = chunks * rows * cols
    g_chunk = c * s.v_local * s.elt
    h_chunk = c * s.h * s.elt
    # g[:, v-tile]: its H / BHW users sit in one group, GROUP_V programs apart, touching
    # GROUP_V g slices + one h slice -> once per chunk; h[:, c-tile]: its GROUP_V users in a
    # group run back to back -> once per group (the next group is a whole h chunk later)
    group = min(GROUP_V, rows)
    between = group * c * bvw * s.elt + c * bhw * s.elt
    g_reads = 1 if fits(between) else cols
    h_reads = 1 if fits(h_chunk + group * c * bvw * s.elt) else math.ceil(rows / group)
    acc = s.v_local * s.h * F32
    out = s.v_local * s.h * s.elt if chunks == 1 else 2 * chunks * acc
    hbm = chunks * (g_reads * g_chunk + h_reads * h_chunk) + out
    l2 = programs * math.ceil(c / TILE_K) * (bvw + bhw) * TILE_K * s.elt
    l2 += 0 if chunks == 1 else 2 * chunks * acc  # the accumulator tiles, in and out
    return Kernel("invariant", "bwd: block_dweight (dW += g^T h, fp32 acc)", _triton_kind(f),
                  2.0 * s.n * s.v_local * s.h, hbm, l2, facts=_facts_text(f))  # fmt: skip


@dataclass(frozen=True)
class Launched(Kernel):
    """A small kernel whose launch is not hidden: ``LAUNCH_S`` per launch plus the longest
    of its compute, HBM and L2 times."""

    @property
    def seconds(self) -> float:
        t = self.times
        return t["launch"] + max(t["compute"], t["hbm"], t["l2"])


def fold_stats_pass(s: Shape) -> Kernel:
    """``fold_stats``: one launch per group of ``FOLD_TOKENS`` tokens folds the block
    statistics of all ``K = V / 256`` blocks (at TP 8 every rank's, all-gathered): reads
    ``S K N`` fp32, writes the ``S N`` root. Its scratch (``S ceil(K / 16)`` fp32 per
    token: 4 MiB per group at ``K = 512``) stays in L2, uncounted."""
    c = chunk(s)
    groups = math.ceil(s.n / max(c, FOLD_TOKENS // c * c))
    k = s.v // VOCAB_BLOCK
    hbm = STATS * k * s.n * F32 + STATS * s.n * F32
    return Launched("invariant", "fwd: fold_stats (all K blocks)", "memory", hbm=hbm,
                    launches=groups, facts="Triton, 1 launch per 8192 tokens")  # fmt: skip


def chunk(s: Shape) -> int:
    """Tokens per chunk of the invariant mode (``triton_ops.invariant.default_chunk``)."""
    return min(CHUNK * max(s.tp, 8), s.n)


def invariant_mode(s: Shape, facts) -> list[Kernel]:
    c, k = chunk(s), s.v_local // VOCAB_BLOCK
    chunks = math.ceil(s.n / c)
    grad = f"bwd: block_grad (g {s.dtype})"
    zero = Kernel("invariant", "bwd: zero-fill fp32 d W acc (torch.zeros)", "memory",
                  hbm=s.v_local * s.h * F32, facts="torch fill")  # fmt: skip
    kernels = [
        block_logits_pass(
            s, facts, "_block_stats_kernel", "fwd: block_stats", chunks * STATS * k * c * F32
        ),
        fold_stats_pass(s),
        *([] if chunks == 1 else [zero]),  # one chunk: d W written directly, no accumulator
        block_logits_pass(s, facts, "_block_grad_kernel", grad, s.n * s.v_local * s.elt),
        dhidden_pass(s, facts),
        block_dweight_pass(s, facts),
    ]  # fp32: the fp32 accumulator is d W itself (``acc.to(fp32)`` copies nothing); bf16:
    copy = Kernel("invariant", "bwd: dW fp32 acc -> bf16", "memory", facts="torch copy",
                  hbm=s.v_local * s.h * (F32 + BF16))  # fmt: skip
    # one chunk: block_dweight writes d W in the input dtype, no accumulator to copy
    return kernels if s.dtype == "fp32" or chunks == 1 else [*kernels, copy]


#: Each mode's kernels, in call order: a new kernel is a new entry.
MODES: dict[str, Callable[[Shape, dict], list[Kernel]]] = {
    "default": default_mode,
    "invariant": invariant_mode,
}


def collective_bytes(s: Shape) -> dict[str, float]:
    """Bytes each rank receives in the TP collectives of one call (0 at TP 1)."""
    from comm_model import collectives

    return {m: sum(c.values()) for m, c in collectives(s, chunk(s)).items()}


def call_seconds(s: Shape, mode: str, kernels: list[Kernel]) -> tuple[float, float, float]:
    """``(total, communication, exposed)`` seconds of one call of ``mode``: the timeline of
    its kernels and collectives in the code's order (``comm_model``), the collectives'
    own time, and the part of it the compute stream waits for."""
    from comm_model import SCHEDULES, collectives, link_seconds, timeline

    total, exposed = timeline(SCHEDULES[mode](s, kernels, chunk(s)))
    comm = sum(link_seconds(b) for b in collectives(s, chunk(s))[mode].values())
    return total, comm, exposed


def predict(s: Shape, facts) -> dict[str, list[Kernel]]:
    return {mode: fn(s, facts) for mode, fn in MODES.items()}


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def table(shapes: list[Shape], facts) -> str:
    from memory_model import memory_lines
    from report import Verdict, markdown_table, verdict_lines

    rows, totals, verdicts, memory = [], [], [], []
    for s in shapes:
        res = predict(s, facts)
        tag = f"{s.n}x{s.h}x{s.v}, TP {s.tp}" + (" per rank" if s.tp > 1 else "")
        line, verdict = memory_lines(s, slab_rows(s.n, s.v_local))
        memory.append(line)
        for mode, kernels in res.items():
            for kn in kernels:
                t = kn.times
                rows.append((tag, mode, kn.name, kn.facts, f"{kn.flops / 1e12:.2f}",
                             f"{kn.hbm / 1e9:.1f}", f"{kn.l2 / 1e9:.1f}", _ms(t["compute"]),
                             _ms(t["hbm"]), _ms(t["l2"]), _ms(kn.seconds), kn.bound))  # fmt: skip
        timed = {m: call_seconds(s, m, ks) for m, ks in res.items()}
        total = {m: t[0] for m, t in timed.items()}
        coll = collective_bytes(s)
        ratio = total["invariant"] / total["default"]
        bf16 = [Verdict(f"predicted invariant / default, {tag}", ratio, INVARIANT_LIMIT)]
        if s.tp in LIMIT_42:
            bf16.append(Verdict(f"issue 42: predicted invariant / default, collectives "
                                f"counted, {tag}", ratio, LIMIT_42[s.tp]))  # fmt: skip
        # log-probs with a per-token upstream gradient: neither mode has a scalar-upstream
        # shortcut, so both run the passes above (the value is a per-token output)
        bf16.append(Verdict(f"predicted invariant / default, log-probs with a per-token "
                            f"upstream, {tag}", ratio, LOGPROB_LIMIT))  # fmt: skip
        if s.v == 131072 and s.tp == 1:
            ms = total["default"] * 1e3
            bf16.append(Verdict(f"predicted default ms / {DEFAULT_MS}, {tag}", ms / DEFAULT_MS, 1))
        verdicts += (bf16 if s.dtype == "bf16" else []) + verdict  # issue 36's are bf16 targets
        compute = {m: sum(kn.seconds for kn in ks) for m, ks in res.items()}
        totals.append((tag, _ms(compute["default"]), _ms(compute["invariant"]),
                       f"{coll['default'] / 1e6:.0f}", f"{coll['invariant'] / 1e6:.0f}",
                       _ms(timed["default"][1]), _ms(timed["invariant"][1]),
                       _ms(timed["default"][2]), _ms(timed["invariant"][2]),
                       _ms(total["default"]), _ms(total["invariant"]),
                       f"{ratio:.2f}"))  # fmt: skip
    head = ("shape", "mode", "kernel", "compiled", "TFLOP", "HBM GB", "L2->SM GB",
            "compute ms", "HBM ms", "L2 ms", "predicted ms", "bound")  # fmt: skip
    tot_head = ("shape", "default compute ms", "invariant compute ms",
                "default collectives MB/rank", "invariant collectives MB/rank",
                "default collectives ms", "invariant collectives ms",
                "default exposed ms", "invariant exposed ms", "default ms", "invariant ms",
                "invariant / default")  # fmt: skip
    return (
        f"Collectives at {LINK_BPS_TEXT} per received byte (assumed); exposed: the time "
        "the compute stream waits for them; ms: compute + exposed.\n\n"
        f"{markdown_table(tot_head, totals)}\n\nIssues 36's and 42's targets, as predicted:\n\n"
        f"{verdict_lines(verdicts) or '- none at this dtype (they are bf16 targets)'}\n\n"
        "Peak extra memory, *predicted* (bench/gpu/memory_model.py):\n\n"
        f"{chr(10).join(memory)}\n\n{markdown_table(head, rows)}\n"
    )


def predicted_ms(n: int, h: int, v: int, tp: int = 1, facts=None, dtype: str = "bf16"):
    """``{"ours_default": ms, "ours_invariant": ms}`` of one call (the speed stage's
    predicted column; per rank at ``tp > 1``, collectives counted as ``call_seconds``)."""
    s = Shape(n, h, v, tp, dtype)
    res = predict(s, facts or load_facts())
    return {f"ours_{m}": 1e3 * call_seconds(s, m, ks)[0] for m, ks in res.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[131072, 262144])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    args = p.parse_args(argv)
    facts = load_facts()
    shapes = [Shape(args.n, args.hidden, v, tp, args.dtype) for v in args.vocab for tp in args.tp]
    print(f"*Predicted* (roofline, no measurement), {DEVICE}, {args.dtype} mean CE fwd+bwd;")
    print(f"command: `python bench/gpu/roofline.py {' '.join(argv or sys.argv[1:])}`\n")
    print(table(shapes, facts))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
