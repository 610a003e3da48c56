"""Benchmark the colocated bridge on 8 CPU ranks: bytes versus the lower bound, and time
of communicate+backward versus the bare collectives of the same bytes in the same run.

Lower bound on bytes each rank must receive (m = per-rank src activation bytes): FAN_IN
forward (k-1)·m, FAN_OUT backward (k-1)·m/k, EQUAL 0; the dest-CP gradient all-reduce is
listed separately (it is required whenever dest CP > 1). "bare" times the same collectives
(all-gather of the same bytes in the same group, plus the CP all-reduce when there is one)
without the bridge around them, alternating with the bridge run by run. Times are
medians over iterations of the slowest rank. "checked" times the same bridge step with
the agreement check on (``MP_BRIDGE_CHECK=1``: one ``[n, 20]`` int64 all-gather over
the call's group and a host read before the collective), alternated with the others in
the same rounds; the other columns run with the check off.
Prints a table and the command; never asserts on time.

A second table (``bench/bridge_ragged.py``) runs ``communicate_ragged`` on the same
layouts with skewed per-sample token counts: exact bytes versus the bound, time versus a
bare exchange of the same bytes and versus the uniform bridge padded to the largest
sample. The machine's load average is printed before and after.

    python bench/bridge.py [--iters 50] [--batch 16] [--seq 128] [--hidden 256]
                           [--tables uniform,ragged]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bridge_ragged import bench_ragged_layout, ragged_table

from mp_bridge.comm import ColocatedBridgeCommunicator, all_gather_tensor
from mp_bridge.grid import make_grid
from mp_bridge.testing import CollectiveCounter, current_device, run_distributed

WORLD = 8
# (encoder layout, llm layout)
LAYOUTS = [
    (dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)),
    (dict(tp=1, dp=8), dict(tp=2, cp=2, dp=2)),
    (dict(tp=2, dp=4), dict(tp=4, dp=2)),
    (dict(tp=4, dp=2), dict(tp=1, cp=2, dp=4)),
    (dict(tp=8, dp=1), dict(tp=1, dp=8)),
    (dict(tp=2, dp=4), dict(tp=1, cp=2, dp=4)),
]


def _spec(d: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


def _timed(fns, iters: int) -> list[float]:
    """Median seconds of each ``fn()`` over ``iters`` rounds, each run after a barrier.

    The functions alternate within a round, so a change in machine load (the CPU is
    shared) hits both sides of a ratio alike instead of biasing whichever ran later.
    """
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, acc in zip(fns, times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _checked(fn):
    """``fn`` with the agreement checks on (``MP_BRIDGE_CHECK`` is read at every call)."""

    def run() -> None:
        os.environ["MP_BRIDGE_CHECK"] = "1"
        try:
            fn()
        finally:
            os.environ["MP_BRIDGE_CHECK"] = "0"

    return run


def _bench_layout(src: dict, dest: dict, args: argparse.Namespace) -> dict:
    device = current_device()
    src_grid = make_grid(**src, create=())
    dest_grid = make_grid(**dest, create=("cp",))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        k, cp, direction = bridge.scale, bridge.plan.cp_size, bridge.direction.name
        b_src = args.batch // src["dp"]
        x = torch.randn(b_src, args.seq, args.hidden, device=device, requires_grad=True)
        with torch.no_grad():
            grad_y = torch.randn(bridge.communicate(x).shape, device=device)
        m = x.numel() * x.element_size()
        # The bare all-gather moves the same pieces: src shards (FAN_IN forward) or the
        # dest-shard gradients (FAN_OUT backward).
        piece = x.detach() if direction == "FAN_IN" else grad_y
        gather, cp_group = bridge.gather_group, bridge.cp_group

        def step() -> None:
            x.grad = None
            bridge.communicate(x).backward(grad_y)

        def bare() -> None:
            if gather is not None:
                all_gather_tensor(piece, gather, 0)
            if cp_group is not None:
                dist.all_reduce(grad_y.clone(), group=cp_group)

        with CollectiveCounter() as counter:
            step()
        for _ in range(2):  # warm-up: the first collectives on a new group set up links
            step()
            bare()
            _checked(step)()
        t_bridge, t_bare, t_checked = _timed([step, bare, _checked(step)], args.iters)
    lower = {"FAN_IN": (k - 1) * m, "FAN_OUT": (k - 1) * m // k, "EQUAL": 0}[direction]
    return dict(
        layout=f"{_spec(src)} -> {_spec(dest)}",
        direction=direction,
        k=k,
        cp=cp,
        m=m,
        ag=counter.bytes_received("all_gather"),
        lower=lower,
        ar=counter.bytes_received("all_reduce"),
        t_bridge=t_bridge,
        t_bare=t_bare,
        t_checked=t_checked,
    )


def _worker(args: argparse.Namespace) -> dict[str, list[dict]]:
    out = {}
    if "uniform" in args.tables:
        out["uniform"] = [_bench_layout(src, dest, args) for src, dest in LAYOUTS]
    if "ragged" in args.tables:
        out["ragged"] = [bench_ragged_layout(src, dest, args) for src, dest in LAYOUTS]
    return out


def _print_table(table: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[j]) for r in table) for j in range(len(table[0]))]
    for j, r in enumerate(table):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def _load() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16, help="global batch (divisible by 8)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tables", default="uniform,ragged", help="comma list of: uniform, ragged")
    args = parser.parse_args(argv)
    args.tables = set(args.tables.split(","))
    if not args.tables <= {"uniform", "ragged"}:
        parser.error(f"--tables {sorted(args.tables)}: choose from uniform, ragged")
    load_before = _load()
    os.environ["MP_BRIDGE_CHECK"] = "0"  # the ranks inherit it; "checked" turns it on
    results = run_distributed(_worker, WORLD, args, backend="gloo", timeout_s=1800)
    print(f"{load_before} (before), {_load()} (after)\n")
    if "uniform" in args.tables:
        _print_uniform([r["uniform"] for r in results], args)
    if "ragged" in args.tables:
        print(
            f"\nragged bridge, {WORLD} gloo ranks on CPU, fp32 [T, h={args.hidden}], "
            f"global batch {args.batch} samples of 0-4 images x 64-576 tokens; median of "
            f"{args.iters} rounds (methods alternated), slowest rank\n"
        )
        _print_table(ragged_table([r["ragged"] for r in results]))
    print("\ncommand: " + " ".join(shlex.quote(a) for a in ["python", *sys.argv]))
    return 0


def _print_uniform(per_rank: list[list[dict]], args: argparse.Namespace) -> None:
    head = (
        "layout (encoder -> llm)",
        "dir",
        "k",
        "cp",
        "m KiB",
        "gather KiB/rank (max)",
        "bound KiB",
        "cp all-reduce KiB",
        "bridge ms",
        "bare ms",
        "ratio",
        "checked ms",
        "check cost ms",
    )
    table = [head]
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        ag = max(r["ag"] for r in ranks)
        ok = all(r["ag"] == r["lower"] for r in ranks)
        t_bridge = max(r["t_bridge"] for r in ranks) * 1e3
        t_bare = max(r["t_bare"] for r in ranks) * 1e3
        t_checked = max(r["t_checked"] for r in ranks) * 1e3
        has_comm = row["k"] > 1 or row["cp"] > 1
        table.append(
            (
                row["layout"],
                row["direction"],
                str(row["k"]),
                str(row["cp"]),
                f"{row['m'] / 1024:.0f}",
                f"{ag / 1024:.0f}" + (" (= bound)" if ok else " (!= bound)"),
                f"{row['lower'] / 1024:.0f}",
                f"{max(r['ar'] for r in ranks) / 1024:.0f}",
                f"{t_bridge:.2f}",
                f"{t_bare:.2f}" if has_comm else "-",
                f"{t_bridge / t_bare:.2f}x" if has_comm and t_bare > 0 else "-",
                f"{t_checked:.2f}",
                f"{t_checked - t_bridge:+.2f}",
            )
        )
    print(f"colocated bridge, {WORLD} gloo ranks on CPU, fp32 [b, s={args.seq}, h={args.hidden}]")
    print(f"global batch {args.batch}, median of {args.iters} iterations, slowest rank\n")
    _print_table(table)


if __name__ == "__main__":
    sys.exit(main())
