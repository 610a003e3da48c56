"""Time of ``route`` (forward + backward, 8 CPU ranks) and of its plan alone (1 process).

Layout: encoder ``tp=2, dp=4`` -> LLM ``tp=2, cp=4, dp=1`` (FAN_IN k=4), SP on, ``h = 1024``
fp32, 2 samples per encoder rank, ``S = 1024`` with ``S_img = 256`` image tokens per sample
at random positions (one seed), the same batch every step (a training loop with a fixed
layout). ``route`` times are the median over steps of the slowest rank's forward+backward
(a barrier before each step), and each rank's CPU time (``process_time``: less
sensitive to a loaded machine's scheduling); ``plan`` times are one process (one thread, like each
rank) planning rank 0's route (``route_needs`` + ``plan_route``; CPU time, best of 5 means
of 10) and a cache
hit of the communicator's plan cache (the key ``route`` builds + ``PlanCache.get``).

Run: ``PYTHONPATH=. python bench/route_time.py`` (report ``uptime``'s load with it).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from mp_bridge.comm import ColocatedBridgeCommunicator, PartitionAdapter, pad_layout
from mp_bridge.comm.bridge.plans.bridge_plan import plan_bridge
from mp_bridge.comm.bridge.plans.plan_cache import PlanCache
from mp_bridge.comm.bridge.plans.route import (
    image_token_shards,
    plan_route,
    route_groups,
    route_needs,
)
from mp_bridge.grid import GridLayout, make_grid
from mp_bridge.table import format_table
from mp_bridge.testing import run_distributed

H, S, S_IMG, B_SRC, STEPS = 1024, 1024, 256, 2, 20
SRC, DEST = dict(tp=2, dp=4), dict(tp=2, cp=4, dp=1)
ORDER = ("tp", "cp", "pp", "dp")


def _masks(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    masks = torch.zeros(n, S, dtype=torch.bool)
    for i in range(n):
        masks[i, torch.randperm(S, generator=gen)[:S_IMG]] = True
    return masks


def _rank_times() -> list[tuple[float, float]]:
    src_grid = make_grid(**SRC, axis_names=ORDER, create=())
    dest_grid = make_grid(**DEST, axis_names=ORDER, create=("cp", "tp"))
    masks = _masks(B_SRC * SRC["dp"])
    x = torch.randn(B_SRC * S_IMG, H, requires_grad=True)
    part = PartitionAdapter(
        cp_group=dest_grid.get_pg("cp"), tp_group=dest_grid.get_pg("tp"), sequence_parallel=True
    )
    times = []
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        for _ in range(STEPS + 2):  # 2 warm-up steps
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            y = bridge.route(x, tokens_per_sample=[S_IMG] * B_SRC, image_mask=masks, partition=part)
            y.sum().backward()
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times[2:]


def _plan_times(reps: int = 10) -> tuple[float, float]:
    """Seconds per plan of rank 0's route (``route_needs`` + ``plan_route``) and per cache
    hit (the key ``route`` builds + ``PlanCache.get``), one process."""
    torch.set_num_threads(1)  # as each rank of run_distributed
    s_lay = GridLayout((SRC["tp"], 1, 1, SRC["dp"]), ORDER)
    d_lay = GridLayout((DEST["tp"], DEST["cp"], 1, DEST["dp"]), ORDER)
    plan = plan_bridge(s_lay, d_lay)
    members = route_groups(plan)[0]
    masks = _masks(B_SRC * SRC["dp"])
    layout = pad_layout(S, DEST["cp"], DEST["tp"], sequence_parallel=True)
    batches = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(reps):
            shards = {0: image_token_shards(masks, layout)}
            totals = {s: B_SRC * S_IMG for s in range(SRC["dp"])}
            holds, needs = route_needs(
                plan, members, pieces=DEST["tp"], src_totals=totals, dest_shards=shards
            )
            plan_route(members, 0, holds, needs)
        batches.append((time.process_time() - t0) / reps)
    plan_s = min(batches)
    cache = PlanCache()

    def hit():
        key = (
            DEST["tp"],
            tuple(totals.items()),
            tuple((d, s.numpy().tobytes()) for d, s in shards.items()),
        )
        return cache.get(key, lambda: plan_route(members, 0, holds, needs))

    hit()  # the one miss
    t0 = time.process_time()
    for _ in range(10 * reps):
        hit()
    return plan_s, (time.process_time() - t0) / (10 * reps)


def main() -> None:
    per_rank = run_distributed(_rank_times, 8)
    slowest = [max(t for t, _ in step) for step in zip(*per_rank)]
    cpu = [statistics.median(c for _, c in steps) for steps in per_rank]  # per rank
    rows = [("quantity", "median ms", "min ms")]
    rows.append(
        (
            "route fwd+bwd (slowest rank)",
            f"{statistics.median(slowest) * 1e3:.1f}",
            f"{min(slowest) * 1e3:.1f}",
        )
    )
    rows.append(
        (
            "route fwd+bwd CPU time per rank (median over steps, mean over ranks)",
            f"{statistics.mean(cpu) * 1e3:.1f}",
            f"{min(cpu) * 1e3:.1f}",
        )
    )
    plan_s, hit_s = _plan_times()
    rows.append(("plan (route_needs + plan_route), 1 process, CPU", f"{plan_s * 1e3:.2f}", "-"))
    rows.append(("cache hit (key + PlanCache.get), 1 process, CPU", f"{hit_s * 1e3:.3f}", "-"))
    print("command: PYTHONPATH=. python bench/route_time.py")
    print(
        f"encoder {SRC} -> llm {DEST} sp, h={H} fp32, S={S}, S_img={S_IMG}, {B_SRC} "
        f"samples/rank, G={B_SRC * S_IMG * SRC['dp']}, {STEPS} steps"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
