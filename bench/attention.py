"""Attention at long lengths on CPU: ``context_parallel_attention`` against SDPA.

Forward + backward, causal, 8 heads, d = 64, one thread per process; fp32 and bf16.
Sections (``--sections``):

- ``one``: one process, ``S`` in ``--sizes``, plain positions (the adapter's layout) and
  a packed layout of 8 documents, against SDPA on the same tensors (packed: one SDPA call
  per document, the best SDPA can do without a mask);
- ``cp``: CP 2 and 4 on gloo (``--cp-sizes``, ``S`` in ``--cp-lengths``), each mode,
  against one-process SDPA on the full sequence: per-rank CPU time of the process (ranks
  share the cores here, so wall time is not the measure), the all-gather mode's share of
  it spent in its collectives, and per-rank peak memory;
- ``encoder``: 64 images of 256 to 1024 tokens, ``image_attention`` against one SDPA call
  per image.

Memory: peak RSS during the call minus RSS before it (``VmHWM`` reset through
``/proc/self/clear_refs``). Methods alternate run by run in one process (``--reps``
rounds, median, spread = (max - min) / median); the load average is printed before and
after. Never asserted.

    python bench/attention.py [--sections one,cp,encoder] [--sizes 4096,8192,16384]
        [--reps 3] [--dtypes fp32,bf16] [--cp-sizes 2,4] [--cp-lengths 16384,65536]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from mp_bridge.comm import PartitionAdapter, pad_layout
from mp_bridge.layers import context_parallel_attention, image_attention
from mp_bridge.table import format_table

H, D = 8, 64
ONE_HEAD = ["S", "dtype", "input", "ours s", "sdpa s", "time x", "ours MiB", "sdpa MiB", "mem x"]
CP_HEAD = [
    "S",
    "cp",
    "comm",
    "rank cpu s",
    "sdpa 1p cpu s",
    "x (sdpa/cp)",
    "collective share",
    "rank peak MiB",
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large buffers are mmapped, freed to the OS


DEVICE = torch.device("cpu")
LINES: list[str] = []


def emit(*parts, flush=True) -> None:
    """Print, and keep the text for ``--out``."""
    text = " ".join(str(p) for p in parts)
    LINES.append(text)
    print(text, flush=flush)


def measure(fn) -> tuple[float, float, int]:
    """``(cpu seconds, wall seconds, peak RSS bytes above the start)`` of ``fn()``; freed
    heap is returned to the OS first, so a method is not charged for (or helped by) what
    the previous one left in the allocator."""
    gc.collect()
    if DEVICE.type == "cuda":  # peak allocated above the start; time after a sync
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - w0
        return time.process_time() - c0, wall, torch.cuda.max_memory_allocated() - before
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS:")
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0, _status("VmHWM:") - before


def _fwd_bwd(call, tensors):
    def run():
        ts = [t.detach().clone().requires_grad_() for t in tensors]
        out = call(*ts)
        out.backward(torch.ones_like(out))

    return run


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


def _sdpa_docs(lengths):
    def call(q, k, v):
        parts = zip(*(t.split(lengths, 1) for t in (q, k, v)))
        return torch.cat([_sdpa(*p) for p in parts], 1)

    return call


def _docs(s: int) -> list[int]:
    """8 documents of mixed lengths summing to ``s``."""
    w = [3, 1, 4, 1, 5, 9, 2, 6]
    lengths = [s * x // sum(w) for x in w]
    lengths[-1] += s - sum(lengths)
    return lengths


def _rounds(methods: dict, reps: int) -> dict[str, list]:
    got = {m: [] for m in methods}
    names = list(methods)
    for r in range(reps):
        for m in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            got[m].append(measure(methods[m]))
    return got


def _t(xs):
    """The time column: the process's CPU seconds on CPU (1 thread: robust to other load),
    wall seconds after a sync on CUDA."""
    return _median(xs, 1 if DEVICE.type == "cuda" else 0)


def _tspread(xs):
    return _spread(xs, 1 if DEVICE.type == "cuda" else 0)


def _median(xs, i):
    return statistics.median(x[i] for x in xs)


def _spread(xs, i):
    vals = [x[i] for x in xs]
    return (max(vals) - min(vals)) / max(statistics.median(vals), 1e-12)


def section_one(args) -> list[list[str]]:
    rows = []
    for s in args.sizes:
        for dname in args.dtypes:
            g = torch.Generator().manual_seed(0)
            qkv = [torch.randn(1, s, H, D, generator=g).to(DEVICE, DTYPES[dname]) for _ in range(3)]
            docs = _docs(s)
            packed = pad_layout(s, 1, cu_seqlens=[0, *torch.tensor(docs).cumsum(0).tolist()])
            plain = pad_layout(s, 1)
            methods = {
                "ours plain": _fwd_bwd(
                    lambda q, k, v, lay=plain: context_parallel_attention(q, k, v, layout=lay), qkv
                ),
                "sdpa plain": _fwd_bwd(_sdpa, qkv),
                "ours packed": _fwd_bwd(
                    lambda q, k, v, lay=packed: context_parallel_attention(q, k, v, layout=lay), qkv
                ),
                "sdpa packed": _fwd_bwd(_sdpa_docs(docs), qkv),
            }
            got = _rounds(methods, args.reps)
            for kind in ("plain", "packed"):
                ours, ref = got[f"ours {kind}"], got[f"sdpa {kind}"]
                rows.append(
                    [
                        str(s),
                        dname,
                        kind,
                        f"{_t(ours):.2f} ({_tspread(ours):.0%})",
                        f"{_t(ref):.2f} ({_tspread(ref):.0%})",
                        f"{_t(ours) / _t(ref):.2f}",
                        f"{_median(ours, 2) / 2**20:.0f}",
                        f"{_median(ref, 2) / 2**20:.0f}",
                        f"{_median(ours, 2) / max(_median(ref, 2), 1):.2f}",
                    ]
                )
            emit(format_table([ONE_HEAD, *rows[-2:]]), flush=True)
    return rows


def section_encoder(args) -> list[list[str]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(256, 1025, (args.images,), generator=g).tolist()
    t = sum(lengths)
    qkv = [torch.randn(1, t, H, D, generator=g).to(DEVICE) for _ in range(3)]

    def per_image(q, k, v):
        parts = zip(*(x.split(lengths, 1) for x in (q, k, v)))
        return torch.cat(
            [
                F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in p)).transpose(1, 2)
                for p in parts
            ],
            1,
        )

    methods = {
        "ours": _fwd_bwd(lambda q, k, v: image_attention(q, k, v, lengths), qkv),
        "sdpa per image": _fwd_bwd(per_image, qkv),
    }
    got = _rounds(methods, args.reps)
    o, r = got["ours"], got["sdpa per image"]
    return [
        [
            f"{args.images} images, T={t}",
            f"{_t(o):.2f} ({_tspread(o):.0%})",
            f"{_t(r):.2f} ({_tspread(r):.0%})",
            f"{_t(o) / _t(r):.2f}",
            f"{_median(o, 2) / 2**20:.0f}",
            f"{_median(r, 2) / 2**20:.0f}",
        ]
    ]


def _cp_worker(s: int, modes: list[str], reps: int):
    import torch.distributed as dist

    import mp_bridge.comm.collectives.kv_gather as kvg
    from mp_bridge.testing import current_device

    global DEVICE
    DEVICE = current_device()
    torch.set_num_threads(1)
    group = dist.group.WORLD
    r = dist.get_rank()
    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **kw):
            c0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.process_time() - c0

        return wrapper

    kvg.all_gather_tensor = timed(kvg.all_gather_tensor)
    kvg.reduce_scatter_tensor = timed(kvg.reduce_scatter_tensor)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, s, H, D, generator=g).to(DEVICE) for _ in range(3)]
    adapter = PartitionAdapter(cp_group=group)
    shards = [adapter.shard(t) for t in full]
    layout = shards[0].layout
    local = [sh.embeddings for sh in shards]
    out = {}
    for rep in range(reps):
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            spent[0] = 0.0
            dist.barrier()
            cpu, wall, mem = measure(
                _fwd_bwd(
                    lambda q, k, v, m=mode: context_parallel_attention(
                        q, k, v, cp_group=group, comm=m, layout=layout
                    ),
                    local,
                )
            )
            out.setdefault(mode, []).append((cpu, wall, mem, spent[0]))
    return r, out


def section_cp(args) -> list[list[str]]:
    from mp_bridge.testing import run_distributed

    rows = []
    modes = ["all_gather", "ring", "a2a"]
    for s in args.cp_lengths:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, s, H, D, generator=g).to(DEVICE) for _ in range(3)]
        ref = _rounds({"sdpa": _fwd_bwd(_sdpa, full)}, 1)["sdpa"]
        ref_cpu = _median(ref, 0)
        del full
        for cp in args.cp_sizes:
            results = run_distributed(_cp_worker, cp, s, modes, args.reps, timeout_s=3600)
            for mode in modes:
                cpu = max(statistics.median(x[0] for x in res[mode]) for _, res in results)
                comm = max(statistics.median(x[3] for x in res[mode]) for _, res in results)
                mem = max(statistics.median(x[2] for x in res[mode]) for _, res in results)
                rows.append(
                    [
                        str(s),
                        str(cp),
                        mode,
                        f"{cpu:.2f}",
                        f"{ref_cpu:.2f}",
                        f"{cpu / (ref_cpu / cp):.2f}",
                        f"{comm / cpu:.0%}" if mode == "all_gather" else "-",
                        f"{mem / 2**20:.0f}",
                    ]
                )
            emit(format_table([CP_HEAD, *rows[-3:]]), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda x: [int(v) for v in x.split(",")]  # noqa: E731
    p.add_argument("--sections", default="one,cp,encoder")
    p.add_argument("--sizes", type=ints, default=[4096, 8192, 16384])
    p.add_argument("--dtypes", type=lambda x: x.split(","), default=["fp32", "bf16"])
    p.add_argument("--cp-sizes", type=ints, default=[2, 4])
    p.add_argument("--cp-lengths", type=ints, default=[16384, 65536])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--images", type=int, default=64, help="encoder: images of 256..1024 tokens")
    p.add_argument("--device", default="cpu", help="cuda: every CP rank on cuda:0 (one GPU)")
    p.add_argument("--out", help="also write the tables here (markdown)")
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda":
        os.environ["MP_BRIDGE_TEST_DEVICE"] = "cuda"  # the CP ranks' tensors on cuda:0
    torch.set_num_threads(1)
    emit("$ python bench/attention.py " + " ".join(sys.argv[1:]))
    name = (
        torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    )
    emit(f"device: {name}, torch {torch.__version__}, 1 CPU thread/process")
    emit("predicted (GPU): time x ~1.0 one process (the same fused kernel, one call per")
    emit("document; the LSE merge is O(S·h·d) against O(S²·h·d)); CP per rank ~1.0 x sdpa/cp")
    emit("load average before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()), flush=True)
    sections = args.sections.split(",")
    if "one" in sections:
        rows = section_one(args)
        emit("\none process, forward + backward (median s (spread), peak MiB above start)")
        emit(format_table([ONE_HEAD, *rows]))
    if "encoder" in sections:
        emit("\nragged encoder, fp32, forward + backward")
        emit(
            format_table(
                [
                    ["batch", "ours s", "sdpa s", "time x", "ours MiB", "sdpa MiB"],
                    *section_encoder(args),
                ]
            )
        )
    if "cp" in sections:
        rows = section_cp(args)
        emit("\nCP on gloo, fp32 plain, per-rank process CPU time (worst rank)")
        emit(format_table([CP_HEAD, *rows]))
    emit("load average after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.out:
        with open(args.out, "w") as f:
            f.write("```\n" + "\n".join(LINES) + "\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
