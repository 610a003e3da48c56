"""Checkpoint save / load on 8 CPU ranks: ``mp_bridge.checkpoint`` against one rank.

Workloads, each with Adam state (one step on zero gradients creates it):

- ``demo``: the demo's colocated MIMO model (encoder tp=2,dp=4 -> LLM tp=2,cp=2,dp=2);
- ``vocab TP t``: a ``VocabParallelEmbedding`` of ``V x H`` (bf16; Adam state bf16) at
  TP t, DP 8/t (t = 2, 4, 8). Default ``V x H = 16381 x 1024`` (padded at TP 2/4/8) on
  this 2-core machine; ``--full`` takes the issue's 65536 x 4096.

Methods, alternated run by run in one process (``--repeat`` rounds, the order rotated):

- ``ours``: ``save(path, model, optim)`` / ``load(path, model, optim)`` (DCP, one file
  per writing rank, DP replicas written once);
- ``rank0``: every rank's shards gathered to global rank 0 (``dist.gather`` per tensor;
  rank 0 assembles the unpadded full tensor from each rank's pieces) then ``torch.save``;
  load: ``torch.load`` on rank 0 then ``dist.scatter`` of each rank's shard. Gather and
  scatter are inside the timed region;
- ``async``: ``save(..., async_save=True)``: the time until it returns (the training
  loop is blocked that long), then ``wait()`` outside the timing; after one warm-up
  asynchronous save, which allocates the model's staging buffers (once per model).

Payload: the sum of the chunk sizes in DCP's metadata (what was written, duplicates
included) against the unpadded parameters plus Adam state of the single-process model
(``expected``): the ratio is 1.000 when every DP replica is written once. The file
overhead (all files on disk minus the payload) is reported apart. Times: median over the
rounds, spread = (max - min) / median; ratio = ours / rank0; MB/s per rank = payload /
8 ranks / seconds (10**6 bytes). Never asserted. ``--profile``: one more ``ours`` save
and load (and the blocked part of an async save) of the last workload under
``cProfile`` on rank 0, its top functions by own
time (which part costs what: serialization, file writes, collectives).

    python bench/checkpoint.py [--full] [--repeat 3] [--vocab V --hidden H] [--tp 2,4,8]
        [--no-demo] [--profile]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from mp_bridge.checkpoint import close, load, read_checkpoint, save
from mp_bridge.checkpoint.entries import model_entries, optimizer_entries
from mp_bridge.grid import make_grid
from mp_bridge.layers import VocabParallelEmbedding
from mp_bridge.table import format_table
from mp_bridge.testing import run_distributed

WORLD = 8


def adam(model) -> torch.optim.Adam:
    """Adam with its state created (one step on zero gradients; weights unchanged)."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim


def demo_workload():
    from mp_bridge.commands.demo import demo_config
    from mp_bridge.models import ReferenceMimo, build_colocated_mimo

    cfg = demo_config(encoder_tp=2, llm_tp=2, seq_factor=4)
    torch.manual_seed(0)
    reference = ReferenceMimo(cfg)
    enc = make_grid(tp=2, dp=4, create=("tp", "dp"))
    llm = make_grid(tp=2, cp=2, dp=2, create=("tp", "cp", "dp", ("dp", "cp")))
    model = build_colocated_mimo(reference, enc, llm, device=torch.device("cpu"))
    full = [p for p in reference.parameters()]
    return model, adam(model), full


def vocab_workload(tp: int, vocab: int, hidden: int):
    grid = make_grid(tp=tp, dp=WORLD // tp, create=("tp", "dp"))
    emb = VocabParallelEmbedding(vocab, hidden, tp_group=grid.get_pg("tp"), dtype=torch.bfloat16)
    full = [torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta")]
    return emb, adam(emb), full


def expected_bytes(full: list[torch.Tensor]) -> int:
    """Unpadded parameters + Adam's exp_avg, exp_avg_sq (their dtype) + one fp32 step each."""
    return sum(3 * p.numel() * p.element_size() + 4 for p in full)


def entries(model, optim) -> list:
    ent = model_entries(model)
    ent.update(optimizer_entries(optim, model)[0])
    return [ent[k] for k in sorted(ent)]


def layouts(items) -> list[list[tuple[int, int]]]:
    """Every rank's ``(group rank, group size)`` per entry (one all_gather_object)."""
    mine = [
        (0, 1)
        if e.spec is None
        else (dist.get_rank(e.spec.group), dist.get_world_size(e.spec.group))
        for e in items
    ]
    out = [None] * WORLD
    dist.all_gather_object(out, mine)
    return out


def pieces_of(entry, local_size: int, rank_layout: tuple[int, int]):
    return entry.spec.pieces(local_size, size=rank_layout[1], rank=rank_layout[0])


def rank0_save(path: str, model, optim) -> None:
    items = entries(model, optim)
    every = layouts(items)
    state = {}
    for i, e in enumerate(items):
        local = e.local.contiguous()
        chunks = [torch.empty_like(local) for _ in range(WORLD)] if dist.get_rank() == 0 else None
        dist.gather(local, chunks, dst=0)
        if dist.get_rank() != 0:
            continue
        if e.spec is None:
            state[e.key] = chunks[0]
            continue
        d = e.spec.dim
        full = local.new_zeros(e.global_shape)
        for r in range(WORLD):
            for p in pieces_of(e, local.shape[d], every[r][i]):
                full.narrow(d, p.full_start, p.length).copy_(
                    chunks[r].narrow(d, p.local_start, p.length)
                )
        state[e.key] = full
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


@torch.no_grad()
def rank0_load(path: str, model, optim) -> None:
    items = entries(model, optim)
    every = layouts(items)
    state = torch.load(path) if dist.get_rank() == 0 else None
    for i, e in enumerate(items):
        out = torch.empty_like(e.local)
        chunks = None
        if dist.get_rank() == 0:
            full = state[e.key]
            if e.spec is None:
                chunks = [full.contiguous()] * WORLD
            else:
                d, chunks = e.spec.dim, []
                for r in range(WORLD):
                    chunk = torch.zeros_like(e.local)
                    for p in pieces_of(e, e.local.shape[d], every[r][i]):
                        chunk.narrow(d, p.local_start, p.length).copy_(
                            full.narrow(d, p.full_start, p.length)
                        )
                    chunks.append(chunk)
        dist.scatter(out, chunks, src=0)
        e.local.copy_(out)
    dist.barrier()


def timed(fn) -> float:
    """Wall seconds of ``fn()`` on the slowest rank (barrier before; max over ranks)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def measure(name: str, model, optim, full, repeat: int, root: str) -> dict:
    ours, base = os.path.join(root, f"{name}.ckpt"), os.path.join(root, f"{name}.pt")
    runs = {k: [] for k in ("ours save", "rank0 save", "async blocked", "ours load", "rank0 load")}

    def async_save():
        handle = {}
        runs["async blocked"].append(
            timed(lambda: handle.update(h=save(ours, model, optim, async_save=True)))
        )
        handle["h"].wait()

    methods = [
        lambda: runs["ours save"].append(timed(lambda: save(ours, model, optim))),
        lambda: runs["rank0 save"].append(timed(lambda: rank0_save(base, model, optim))),
        async_save,
        lambda: runs["ours load"].append(timed(lambda: load(ours, model, optim))),
        lambda: runs["rank0 load"].append(timed(lambda: rank0_load(base, model, optim))),
    ]
    save(ours, model, optim)  # warm-up, and the files the loads read
    save(ours, model, optim, async_save=True).wait()  # the staging buffers (once per model)
    rank0_save(base, model, optim)
    for rnd in range(repeat):
        for k in range(len(methods)):
            methods[(k + rnd) % len(methods)]()
    row = {"workload": name, **{k: statistics.median(v) for k, v in runs.items()}}
    row["spread"] = max((max(v) - min(v)) / statistics.median(v) for v in runs.values())
    if dist.get_rank() == 0:
        _, meta = read_checkpoint(ours)
        logical = sum(
            torch.Size(c.sizes).numel() * md.properties.dtype.itemsize
            for md in meta.state_dict_metadata.values() if hasattr(md, "chunks")
            for c in md.chunks
        )  # fmt: skip
        disk = sum(os.path.getsize(os.path.join(ours, f)) for f in os.listdir(ours))
        row.update(expected=expected_bytes(full), payload=logical, disk=disk,
                   rank0_file=os.path.getsize(base))  # fmt: skip
    dist.barrier()
    return row


def profiled(model, optim, root: str) -> str:
    """rank 0's cProfile of one ``ours`` save, one load and the blocked part of one
    asynchronous save (top 14 by own time each)."""
    import cProfile
    import io
    import pstats

    path = os.path.join(root, "profiled.ckpt")
    out = ""
    for what, fn in (("save", lambda: save(path, model, optim)),
                     ("load", lambda: load(path, model, optim)),
                     ("async save (the blocked part)",
                      lambda: save(path, model, optim, async_save=True))):  # fmt: skip
        prof = cProfile.Profile()
        dist.barrier()
        if dist.get_rank() == 0:
            prof.enable()
        fn()
        if dist.get_rank() == 0:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            out += f"--- rank 0, one {what}, top 14 by own time\n" + text.getvalue()
    close()  # waits for the async save
    return out


def worker(args) -> list[dict]:
    out = []
    if args.demo:
        model, optim, full = demo_workload()
        out.append(measure("demo", model, optim, full, args.repeat, args.dir))
        del model, optim
    for tp in args.tp:
        model, optim, full = vocab_workload(tp, args.vocab, args.hidden)
        out.append(
            measure(f"vocab TP {tp} / DP {WORLD // tp}", model, optim, full, args.repeat, args.dir)
        )
        if args.profile and tp == args.tp[-1]:
            out.append({"profile": profiled(model, optim, args.dir)})
        del model, optim
        close()  # the staging buffers of this workload
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the issue's 65536 x 4096 bf16")
    parser.add_argument("--vocab", type=int, default=16381)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="rounds (methods alternate)")
    parser.add_argument("--tp", default="2,4,8", help="vocab workloads' TP sizes")
    parser.add_argument("--no-demo", dest="demo", action="store_false")
    parser.add_argument("--profile", action="store_true", help="cProfile one save and load")
    args = parser.parse_args()
    args.tp = [int(t) for t in args.tp.split(",")]
    if args.full:
        args.vocab, args.hidden = 65536, 4096
    args.dir = tempfile.mkdtemp(prefix="mp_bridge_ckpt_bench_")
    load_before, start = os.getloadavg(), time.perf_counter()
    try:
        rows = run_distributed(worker, WORLD, args, timeout_s=3600)[0]
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    load_after = os.getloadavg()
    mib = 2.0**20
    cells = [("workload", "expected MiB", "payload / exp", "file overhead MiB", "rank0 file MiB",
              "save s", "rank0 save s", "x", "load s", "rank0 load s", "x", "async blocked",
              "save MB/s/rank", "load MB/s/rank", "spread")]  # fmt: skip
    profile = "".join(r.get("profile", "") for r in rows)
    for r in (r for r in rows if "profile" not in r):
        cells.append((
            r["workload"], f"{r['expected'] / mib:.1f}", f"{r['payload'] / r['expected']:.3f}",
            f"{(r['disk'] - r['payload']) / mib:.2f}", f"{r['rank0_file'] / mib:.1f}",
            f"{r['ours save']:.3f}", f"{r['rank0 save']:.3f}",
            f"{r['ours save'] / r['rank0 save']:.2f}", f"{r['ours load']:.3f}",
            f"{r['rank0 load']:.3f}", f"{r['ours load'] / r['rank0 load']:.2f}",
            f"{r['async blocked']:.3f} s = {r['async blocked'] / r['ours save']:.0%}",
            f"{r['payload'] / WORLD / r['ours save'] / 1e6:.1f}",
            f"{r['payload'] / WORLD / r['ours load'] / 1e6:.1f}",
            f"{r['spread']:.0%}",
        ))  # fmt: skip
    print("command: python bench/checkpoint.py " + " ".join(sys.argv[1:]))
    print(f"8 gloo CPU ranks, vocab {args.vocab} x {args.hidden} bf16, {args.repeat} rounds, "
          f"medians; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; "
          f"{time.perf_counter() - start:.0f} s\n")  # fmt: skip
    print(format_table(cells))
    if profile:
        print("\n" + profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
