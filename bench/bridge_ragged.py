"""Ragged rows of ``bench/bridge.py``: ``communicate_ragged`` on the same layouts.

Per-sample token counts are drawn from a skewed distribution (0-4 images per sample with
weights 35/30/15/12/8 %, each image 64-576 tokens, seed fixed so every rank draws the same
global batch). Each row reports, per rank (max over ranks):

- bytes: the token exchange received versus the exact bound (the other gather-group
  members' tokens, FAN_IN forward; the sibling slots' gradients, FAN_OUT backward), the
  small int64 header + counts, and the dest-CP gradient all-reduce; next to them what the
  uniform bridge moves when every sample is padded to the largest (today's workaround).
- time of forward+backward for four methods, alternated round by round in one process
  (so load changes hit all alike): ``ragged`` (communicate_ragged), ``bare`` (one
  ``all_to_all_single`` of exactly the same token bytes in the same group, plus the CP
  all-reduce), ``bare+hdr`` (FAN_IN only: ``bare`` after the same fixed-size header
  all-gather, i.e. the ragged bridge's collectives without the bridge), ``padded``
  (``communicate`` on ``[b, s_max, h]``). Medians of the slowest rank; spread = the
  largest per-rank interquartile range / median of the ragged runs.

Run through ``bench/bridge.py`` (``--tables ragged`` for this table alone).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch
import torch.distributed as dist

from mp_bridge.comm import (
    ColocatedBridgeCommunicator,
    all_gather_tensor,
    exchange_rows,
    route_ragged,
)
from mp_bridge.grid import make_grid
from mp_bridge.testing import CollectiveCounter, current_device

IMAGE_WEIGHTS = (35, 30, 15, 12, 8)  # P(0..4 images per sample), in percent
IMAGE_TOKENS = (64, 576)


def draw_counts(batch: int, seed: int = 0) -> list[int]:
    """Tokens per sample: 0-4 images (skewed to few), each of 64-576 tokens."""
    gen = random.Random(seed)
    images = gen.choices(range(len(IMAGE_WEIGHTS)), weights=IMAGE_WEIGHTS, k=batch)
    return [sum(gen.randint(*IMAGE_TOKENS) for _ in range(n)) for n in images]


def _timed(fns, iters: int) -> list[list[float]]:
    """Seconds of each ``fn()`` per round; the functions alternate within each round."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, acc in zip(fns, times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return times


def _block(layout, rank: int, batch: int) -> range:
    per = batch // layout.axis_size("dp")
    dp = layout.coords(rank)["dp"]
    return range(dp * per, (dp + 1) * per)


def bench_ragged_layout(src: dict, dest: dict, args: argparse.Namespace) -> dict:
    device, rank = current_device(), dist.get_rank()
    src_grid = make_grid(**src, create=())
    dest_grid = make_grid(**dest, create=("cp",))
    counts = draw_counts(args.batch)
    starts = list(itertools.accumulate([0, *counts]))
    with ColocatedBridgeCommunicator(src_grid, dest_grid) as bridge:
        plan, h = bridge.plan, args.hidden
        k, cp, direction = plan.scale, plan.cp_size, plan.direction.name
        mine = _block(plan.src, rank, args.batch)
        local = [counts[s] for s in mine]
        x = torch.randn(starts[mine.stop] - starts[mine.start], h, device=device)
        x.requires_grad_()
        with torch.no_grad():
            y, _ = bridge.communicate_ragged(x, local)
        grad_y = torch.randn(y.shape, device=device)
        row = h * x.element_size()
        members = plan.gather_group_of(rank) if direction == "FAN_IN" else [rank] * k
        route = route_ragged(
            plan, rank, [[counts[s] for s in _block(plan.src, m, args.batch)] for m in members]
        )
        # Uniform workaround: every sample padded to the largest.
        s_max = max(counts)
        xp = torch.randn(len(local), s_max, h, device=device, requires_grad=True)
        with torch.no_grad():
            grad_yp = torch.randn(bridge.communicate(xp).shape, device=device)
        piece = x.detach() if direction == "FAN_IN" else grad_y
        gather, cp_group = bridge.gather_group, bridge.cp_group

        def ragged() -> None:
            x.grad = None
            bridge.communicate_ragged(x, local)[0].backward(grad_y)

        def bare() -> None:
            if k > 1:
                exchange_rows(piece, gather, route.slot_tokens)
            if cp_group is not None:
                dist.all_reduce(grad_y.clone(), group=cp_group)

        header = torch.zeros(4, dtype=torch.int64, device=device)

        def bare_hdr() -> None:
            all_gather_tensor(header, gather, 0).tolist()  # the ragged bridge syncs on it
            bare()

        def padded() -> None:
            xp.grad = None
            bridge.communicate(xp).backward(grad_yp)

        with CollectiveCounter() as c_ragged:
            ragged()
        with CollectiveCounter() as c_padded:
            padded()
        for _ in range(2):  # warm-up: the first collectives on a new group set up links
            ragged(), bare(), bare_hdr(), padded()
        t_ragged, t_bare, t_hdr, t_padded = _timed([ragged, bare, bare_hdr, padded], args.iters)
    counts_bytes = (k - 1) * 8 * len(local) if direction == "FAN_IN" else 0
    q1, _, q3 = statistics.quantiles(t_ragged, n=4)
    return dict(
        layout=f"{_spec(src)} -> {_spec(dest)}",
        direction=direction,
        k=k,
        cp=cp,
        tokens=route.exchanged_tokens,
        exchange=c_ragged.bytes_received("all_to_all") - counts_bytes,
        bound=route.exchanged_tokens * row,
        small=c_ragged.bytes_received("all_gather") + counts_bytes,
        ar=c_ragged.bytes_received("all_reduce"),
        padded=c_padded.bytes_received("all_gather"),
        padded_ar=c_padded.bytes_received("all_reduce"),
        t_ragged=statistics.median(t_ragged),
        t_bare=statistics.median(t_bare),
        t_hdr=statistics.median(t_hdr),
        t_padded=statistics.median(t_padded),
        spread=(q3 - q1) / statistics.median(t_ragged),
    )


def _kib(ranks: list[dict], key: str) -> str:
    return f"{max(r[key] for r in ranks) / 1024:.0f}"


def _spec(d: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


def ragged_table(per_rank: list[list[dict]]) -> list[tuple[str, ...]]:
    """Rows (header first) from each rank's list of ``bench_ragged_layout`` results."""
    head = (
        "layout (encoder -> llm)",
        "dir",
        "k",
        "cp",
        "exchange KiB/rank (max)",
        "exact bound KiB",
        "header+counts B",
        "cp all-reduce KiB",
        "padded gather KiB",
        "padded cp AR KiB",
        "ragged ms",
        "bare ms",
        "bare+hdr ms",
        "padded ms",
        "ragged/bare",
        "ragged/(bare+hdr)",
        "padded/ragged",
        "spread",
    )
    table = [head]
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        exact = all(r["exchange"] == r["bound"] for r in ranks)
        methods = ("ragged", "bare", "hdr", "padded")
        t = {m: max(r[f"t_{m}"] for r in ranks) * 1e3 for m in methods}
        has_comm = row["k"] > 1 or row["cp"] > 1
        fan_in = row["direction"] == "FAN_IN"
        table.append(
            (
                row["layout"],
                row["direction"],
                str(row["k"]),
                str(row["cp"]),
                _kib(ranks, "exchange") + (" (= bound)" if exact else " (!= bound)"),
                _kib(ranks, "bound"),
                str(max(r["small"] for r in ranks)),
                _kib(ranks, "ar"),
                _kib(ranks, "padded"),
                _kib(ranks, "padded_ar"),
                f"{t['ragged']:.2f}",
                f"{t['bare']:.2f}" if has_comm else "-",
                f"{t['hdr']:.2f}" if fan_in else "-",
                f"{t['padded']:.2f}",
                f"{t['ragged'] / t['bare']:.2f}x" if has_comm and t["bare"] > 0 else "-",
                f"{t['ragged'] / t['hdr']:.2f}x" if fan_in else "-",
                f"{t['padded'] / t['ragged']:.2f}x",
                f"{max(r['spread'] for r in ranks) * 100:.0f}%",
            )
        )
    return table
