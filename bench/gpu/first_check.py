"""The GPU runbook's first check (issue 42): what the next GPU must measure before any
model figure is believed, each *measured* figure next to the roofline's *predicted* one.

Parts (``--parts``; each writes its table to ``--out`` the moment it ends):

- ``kernels``: each invariant kernel of the triton engine (``triton_ops``) timed for
  one chunk of ``--n`` tokens (the default chunk, 8192) at ``--hidden x --vocab``, bf16
  mean cross-entropy, TP 1: ``block_stats``, ``fold_stats``, ``block_grad``, ``dhidden``,
  ``block_dweight_`` (a lone chunk, ``fresh``, and a chunk added to the fp32
  accumulator); beside each, ``bench/gpu/roofline.py``'s *predicted* time for that chunk
  and the ratio. The table names the statistics build in use (``block_stats.stats_build``:
  its ``k`` step and stages), so the bits step that follows (``bench/gpu/bits.py``,
  against ``bench/gpu/invariant_bits.txt``) is known to be that variant's: whatever ``k``
  step the tree builds (the 64-step variant where the tree has it) is compared with the
  recorded bits.
- ``cublas``: the default mode's four slab GEMMs (``triton_ops.default``'s own ``mm_f32`` /
  ``mm_into_`` / ``addmm_f32_``) at ``--n`` tokens and ``Vs`` weight rows per slab
  (``roofline.slab_rows``), each against its predicted time.
- ``nccl``: with two or more GPUs, a 256 MiB all-gather (the output; NCCL, every GPU one
  rank) timed, its bus bandwidth (``(P - 1) / P x 256 MiB / t``, the bytes each rank
  receives per second) against ``comm_model.LINK_BPS`` (350 GB/s, assumed). With one GPU
  it says so and measures nothing. ``--backend gloo`` runs it on CPU (the smoke).

Times: CUDA events around ``--reps`` calls after one warm-up (the JIT compile), the
median; on CPU (``--device cpu``, the interpreter: a smoke of this script, not a figure)
``time.perf_counter``, no warm-up.

    python bench/gpu/first_check.py --out OUT/first.md
    python bench/gpu/first_check.py --device cpu --n 16 --hidden 16 --vocab 256 \\
        --reps 1 --backend gloo --ranks 2 --mib 1 --out /tmp/first.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the triton engine's kernels on CPU: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import roofline  # noqa: E402
from report import markdown_table  # noqa: E402


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up (CUDA: the JIT
    compile; none on CPU, where the interpreter compiles nothing)."""
    if device.type == "cuda":
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _row(name: str, measured: float, predicted: float | None) -> tuple:
    ratio = f"{measured / predicted:.2f}" if predicted else "n/a"
    pred = f"{predicted * 1e3:.3f}" if predicted else "n/a"
    return (name, f"{measured * 1e3:.3f}", pred, ratio)


def _predicted(n: int, h: int, v: int) -> dict[str, float]:
    """Seconds per kernel of one chunk of ``n`` tokens (roofline, TP 1, bf16); the
    accumulating ``block_dweight`` from two chunks, halved."""
    facts = roofline.load_facts()
    one = roofline.predict(roofline.Shape(n, h, v), facts)["invariant"]
    got = {k.name.split(" (")[0][5:]: k.seconds for k in one}  # "fwd: " / "bwd: " off
    two = roofline.predict(roofline.Shape(2 * n, h, v), facts)["invariant"]
    got["block_dweight acc"] = next(k.seconds for k in two if "block_dweight" in k.name) / 2
    return got


def kernels_part(args, dev: torch.device) -> str:
    from mp_bridge.layers.loss.engines.triton_ops import block_stats as bs
    from mp_bridge.layers.loss.engines.triton_ops.block_dweight import accumulator, block_dweight_
    from mp_bridge.layers.loss.engines.triton_ops.block_grad import block_grad
    from mp_bridge.layers.loss.engines.triton_ops.dhidden import dhidden
    from mp_bridge.layers.loss.engines.triton_ops.fold_stats import fold_stats
    from mp_bridge.layers.loss.engines.triton_ops.invariant import TritonInvariantRunner
    from mp_bridge.layers.loss.formulas import LossSpec
    from mp_bridge.layers.vocab_shards import VocabShard

    n, hd, v, dt = args.n, args.hidden, args.vocab, torch.bfloat16
    g0 = torch.Generator().manual_seed(0)
    h = (torch.randn(n, hd, generator=g0) * 0.5).to(dev, dt)
    w = (torch.randn(v, hd, generator=g0) * 0.02).to(dev, dt)
    target = torch.randint(0, v, (n,), generator=g0).to(dev)
    spec = LossSpec.cross_entropy(v, None, 0.0)
    shard = VocabShard.of_rank(1, v, rank=0, vocab_size=v)
    run = TritonInvariantRunner.build(w, None, shard, spec, n)
    k, nv, colw = run.layout.num_local, run._num_valid, run._colw
    temp = torch.ones(n, device=dev)
    tcol = run.columns(target)
    tok = torch.full((n,), 1.0 / n, device=dev)
    st = block_stats(bs, h, w, temp, tcol, k, nv, spec, colw)
    root = fold_stats(st, spec, run.layout.num_real)
    lse = (root[0] + root[1].log()).contiguous()
    g = block_grad(h, w, temp, tcol, lse, tok, None, None, n_blocks=k, num_valid=nv, spec=spec)
    out = torch.empty((n, hd), dtype=torch.float32, device=dev)
    acc = accumulator(k * 256, hd, dev)
    gw = torch.empty_like(w)
    steps = {
        "block_stats": lambda: block_stats(bs, h, w, temp, tcol, k, nv, spec, colw),
        "fold_stats": lambda: fold_stats(st, spec, run.layout.num_real),
        "block_grad": lambda: block_grad(
            h, w, temp, tcol, lse, tok, None, None, n_blocks=k, num_valid=nv, spec=spec
        ),
        "dhidden": lambda: dhidden(g, w, out, k_rows=k * 256, w_rows=v),
        "block_dweight": lambda: block_dweight_(gw, g, h, fresh=True),
        "block_dweight acc": lambda: block_dweight_(acc, g, h),
    }
    pred = _predicted(n, hd, v)
    rows = [_row(name, timed(fn, dev, args.reps), pred.get(name)) for name, fn in steps.items()]
    build, stages = bs.stats_build(dt)
    return (
        f"### Invariant kernels, one chunk of {n} tokens, {n}x{hd}x{v} bf16, TP 1\n\n"
        f"statistics build in use (block_stats.stats_build, bf16): {build}, {stages} stages "
        "(the bits step that follows hashes this build)\n\n"
        + markdown_table(("kernel", "measured ms", "predicted ms", "measured / predicted"), rows)
        + "\n"
    )


def block_stats(bs, h, w, temp, tcol, k, nv, spec, colw):
    return bs.block_stats(
        h, w, temp, tcol, n_blocks=k, num_valid=nv, spec=spec, colw=colw
    )  # fmt: skip


def cublas_part(args, dev: torch.device) -> str:
    from mp_bridge.layers.loss.engines.triton_ops.default import (
        addmm_f32_,
        mm_f32,
        mm_into_,
    )

    n, hd, v = args.n, args.hidden, args.vocab
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32  # CPU: no bf16 GEMM path
    vs = roofline.slab_rows(n, v)
    slabs = -(-v // vs)
    h = torch.randn(n, hd, device=dev).to(dt)
    w_s = (torch.randn(vs, hd, device=dev) * 0.02).to(dt)
    g = (torch.randn(n, vs, device=dev) * 1e-4).to(dt)
    gw = torch.empty((vs, hd), dtype=dt, device=dev)
    gh = torch.zeros((n, hd), dtype=torch.float32, device=dev)
    kernels = roofline.default_mode(roofline.Shape(n, hd, v), roofline.load_facts())
    pred = [k.seconds / slabs for k in kernels if k.facts == "cuBLAS"]
    calls = [
        (f"fwd: z = h W_s^T [{n}, {hd}] x [{hd}, {vs}], fp32 out", lambda: mm_f32(h, w_s.t())),
        (f"bwd: z again [{n}, {hd}] x [{hd}, {vs}], fp32 out", lambda: mm_f32(h, w_s.t())),
        (f"bwd: dW_s = g^T h [{vs}, {n}] x [{n}, {hd}], in place", lambda: mm_into_(gw, g.t(), h)),
        (f"bwd: dh += g W_s [{n}, {vs}] x [{vs}, {hd}], fp32 acc", lambda: addmm_f32_(gh, g, w_s)),
    ]
    rows = [_row(name, timed(fn, dev, args.reps), p) for (name, fn), p in zip(calls, pred)]
    head = ("GEMM (one slab)", "measured ms", "predicted ms", "measured / predicted")
    return (
        f"### cuBLAS at the default mode's four slab GEMMs, N {n}, Vs {vs} ({slabs} slabs of "
        f"{n}x{hd}x{v}), {str(dt).removeprefix('torch.')}\n\n" + markdown_table(head, rows) + "\n"
    )


def _gather_rank(rank: int, world: int, port: int, backend: str, nbytes: int, reps: int, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    inp = torch.ones(nbytes // 2 // world, dtype=torch.bfloat16, device=dev)

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather():
        fn(out, inp)

    dist.barrier()
    seconds = timed(gather, dev, reps)
    dist.barrier()
    if rank == 0:
        q.put(seconds)
    dist.destroy_process_group()


def nccl_part(args, dev: torch.device) -> str:
    import socket

    import torch.multiprocessing as mp

    ranks = args.ranks or (torch.cuda.device_count() if dev.type == "cuda" else 1)
    title = f"### All-gather of {args.mib} MiB ({args.backend})\n\n"
    if ranks < 2:
        return title + f"skipped: {ranks} GPU on this machine; nothing measured.\n"
    nbytes = args.mib * 2**20
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")  # no fork of a process that has run torch / triton
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_gather_rank,
            args=(r, ranks, port, args.backend, nbytes, args.reps, q),
            daemon=True,  # a hung rank dies with this process
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        seconds = q.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    from comm_model import LINK_BPS

    bus = (ranks - 1) / ranks * nbytes / seconds
    row = (f"{ranks}", f"{seconds * 1e3:.3f}", f"{bus / 1e9:.1f}", f"{LINK_BPS / 1e9:.0f}",
           f"{bus / LINK_BPS:.2f}")  # fmt: skip
    head = ("ranks", "measured ms", "bus GB/s", "assumed GB/s", "measured / assumed")
    return title + markdown_table(head, [row]) + "\n"


PARTS = {"kernels": kernels_part, "cublas": cublas_part, "nccl": nccl_part}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=131072)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--ranks", type=int, default=0, help="all-gather ranks (0: every GPU)")
    p.add_argument("--mib", type=int, default=256, help="all-gather output MiB")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", required=True, help="markdown file to write")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    texts = [f"command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`\n"]
    if dev.type == "cpu":
        texts.append("CPU smoke (the interpreter): these times are not GPU figures.\n")
    for part in args.parts:
        texts.append(PARTS[part](args, dev))
        Path(args.out).write_text("\n".join(texts))  # each part kept the moment it ends
        print(texts[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
