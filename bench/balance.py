"""Estimated encoder cost per DP replica before and after the balance plan (host only).

A skewed long-tail batch, seeded: per sample a heavy-tailed number of images (30 %
text-only, then ``min(16, ⌊Pareto(1.1)⌋)``) and per image a heavy-tailed token count
(``min(4096, ⌊64·Pareto(1.3)⌋)``; ``long_tail_images`` of ``mp_bridge.models.data``, which
``synthetic_batch(images="long-tail")`` draws from); ``SAMPLES`` samples per encoder DP
replica. Cost per image ``t² + c·t`` with ``c = 2·h + ffn`` of a ViT-L-like encoder
(``h=1024, ffn=4096``).

Prints, for one batch on 8 replicas, each replica's estimated cost (units of ``10⁶``)
before and after, then over ``SEEDS`` batches per DP size: max/mean before and after,
Graham's bound ``(mean + p_max·(m−1)/m)/mean`` and the lower bound ``max(mean, p_max)/mean``
that no whole-image assignment beats, the share of image rows that move, plan time.
Estimated costs only: measured encoder times come with the model step (no timing
asserts anywhere). Run: ``PYTHONPATH=. python bench/balance.py``
"""

from __future__ import annotations

import statistics
import time

import torch

from mp_bridge.comm.bridge.plans.balance_plan import plan_balance
from mp_bridge.models.data import long_tail_images
from mp_bridge.table import format_table

SAMPLES, SEEDS, C = 8, 20, 2 * 1024 + 4096


def long_tail_batch(replicas: int, seed: int) -> list[list[int]]:
    """Tokens per image of each replica's ``SAMPLES`` samples (sample-major)."""
    gen = torch.Generator().manual_seed(seed)
    return [long_tail_images(gen, SAMPLES)[1] for _ in range(replicas)]


def main() -> None:
    print("command: PYTHONPATH=. python bench/balance.py")
    print(f"cost t^2 + c*t, c={C}; {SAMPLES} samples per replica; long-tail seed 0, 8 replicas")
    tokens = long_tail_batch(8, 0)
    plan = plan_balance(tokens, c=float(C))
    rows = [("replica", "images", "tokens", "cost before (M)", "images after", "cost after (M)")]
    for d in range(8):
        rows.append((
            str(d), str(len(tokens[d])), str(sum(tokens[d])), f"{plan.loads_before[d] / 1e6:.1f}",
            str(len(plan.tokens_after(d))), f"{plan.loads_after[d] / 1e6:.1f}",
        ))  # fmt: skip
    print(format_table(rows))
    print(f"max/mean {plan.ratio_before():.3f} -> {plan.ratio_after():.3f}; {plan!r}\n")

    rows = [("replicas", "max/mean before", "after", "Graham bound", "lower bound",
             "rows moved", "plan ms")]  # fmt: skip
    for m in (4, 8, 16, 32):
        stats: dict[str, list[float]] = {k: [] for k in rows[0][1:]}
        for seed in range(SEEDS):
            tokens = long_tail_batch(m, seed)
            start = time.perf_counter()
            plan = plan_balance(tokens, c=float(C))
            stats["plan ms"].append(1e3 * (time.perf_counter() - start))
            mean = sum(plan.loads_before) / m
            p_max = max(c for r in plan.costs for c in r)
            stats["max/mean before"].append(plan.ratio_before())
            stats["after"].append(plan.ratio_after())
            stats["Graham bound"].append((mean + p_max * (m - 1) / m) / mean)
            stats["lower bound"].append(max(mean, p_max) / mean)
            stats["rows moved"].append(plan.moved_rows / max(sum(map(sum, tokens)), 1))
        rows.append((str(m), *(_cell(k, v) for k, v in stats.items())))
    print(f"over {SEEDS} seeds: median [max]")
    print(format_table(rows))


def _cell(key: str, values: list[float]) -> str:
    fmt = "{:.1%}" if key == "rows moved" else "{:.2f}" if key == "plan ms" else "{:.3f}"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(max(values))}]"


if __name__ == "__main__":
    main()
