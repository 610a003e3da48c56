"""Start-up time of a test world by start method: fork, forkserver, spawn.

Each round starts an ``--world``-rank gloo world with ``run_distributed`` (one all-reduce,
then teardown) once per method, methods in turn; the table gives best / worst seconds per
method over the rounds, the load average before and after, and the device. The first
forkserver world also pays for starting the server (it imports ``torch`` once); that first
start is reported on its own line.

    .venv/bin/python bench/rank_startup.py --world 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch
import torch.distributed as dist

from mp_bridge.table import format_table
from mp_bridge.testing import run_distributed


def _one_all_reduce() -> float:
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["fork", "forkserver", "spawn"])
    args = p.parse_args()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    first_server = None
    for _ in range(args.rounds):
        for method in args.methods:
            start = time.perf_counter()
            out = run_distributed(_one_all_reduce, args.world, start_method=method)
            elapsed = time.perf_counter() - start
            assert out == [float(args.world)] * args.world, out
            if method == "forkserver" and first_server is None:
                first_server = elapsed  # includes starting the server
                continue
            times[method].append(elapsed)
    rows = [("method", "best s", "worst s", "worlds")]
    rows += [(m, f"{min(t):.2f}", f"{max(t):.2f}", str(len(t))) for m, t in times.items() if t]
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print(f"load average before: {load_before[0]:.2f}, after: {os.getloadavg()[0]:.2f}")
    print(format_table(rows))
    if first_server is not None:
        print(f"first forkserver world, server start included: {first_server:.2f} s")


if __name__ == "__main__":
    main()
