"""Balanced encoders on a long-tail image batch: unbalanced vs balanced step, 8 CPU ranks.

    PYTHONPATH=. python bench/encoder_balance.py [--iters 3 --batches 2 --samples 4]

Layout: encoder ``tp=2, dp=4`` -> LLM ``tp=2, cp=2, dp=2``, routed flow, one model
(``balance=True``) whose ``balancer`` is switched off for the unbalanced step (same
weights, groups, batches). Encoder work dominates: ``--enc-layers`` blocks of hidden
``--enc-hidden`` 384 (8 heads, FFN 4h; cost ``c = 2h + ffn = 2304``) against a 1-layer LLM
of hidden 32 (2 heads: its cost is mostly attention over ``S = 2048``).
Images: :func:`~mp_bridge.models.data.long_tail_images` with ``max_images=4``,
``max_tokens=512``, ``base=64`` (30 % text-only samples, Pareto tails of images per sample
and tokens per image), ``--samples`` samples per encoder DP replica, batch ``k`` seeded
``k``; the same batches in both modes.

A step is ``zero_grad`` + forward + backward + ``sync_gradients``; the two modes alternate
step by step (order swapped every iteration; a barrier before each step). The route and
balance caches are cleared before every step, so each step plans anew as a step on a new
batch would. Per rank:

- encoder fwd+bwd: inside the step, from the encoder's forward pre-hook to the
  projection's forward hook, plus from the gradient reaching the projection output to
  the patch embedding's weight gradient; thread CPU time (``time.thread_time``: the
  rank's own work, little disturbed by the other ranks and jobs on the cores) and wall;
  summed over the batches, median over the iterations; ``max / mean`` over the 8 ranks;
- step: wall of the slowest rank (median over iterations, summed over the batches) and
  per-rank thread CPU time (max over ranks); "modeled": what the step would take with
  one core per rank, the slowest rank's encoder CPU plus the slowest rank's other CPU
  (the encoder ends at the route, where every rank waits for the slowest encoder);
- bytes (``CollectiveCounter``, received per rank, max over ranks): the patch move
  (``ImageBalancer.balance``'s ``all_to_all``) and the feature route forward + backward
  (``all_to_all`` rows; metadata all-gathers apart), against the bound computed here from
  the batch's per-image token counts and the plan's destinations: patches, the rows of
  images encoded on this rank's replica that came from another replica (each image at
  most once; the sum over ranks is at most ``tp`` times all image rows); features, rows of
  the rank's CP shard it did not encode (forward) plus rows it encoded that its shard does
  not consume (backward);
- plan: ``ImageBalancer.plan`` on a cleared cache (the count all-gather and
  :func:`plan_balance`) and :func:`plan_balance` alone, summed over the batches; the
  first as a share of the balanced step (modeled and wall).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mp_bridge.comm.bridge.plans.balance_plan import plan_balance  # noqa: E402
from mp_bridge.grid import GridLayout, make_grid  # noqa: E402
from mp_bridge.models import (  # noqa: E402
    MimoConfig,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    dp_shard,
)
from mp_bridge.models.data import MimoBatch, RaggedImages, long_tail_images  # noqa: E402
from mp_bridge.table import format_table  # noqa: E402
from mp_bridge.testing import CollectiveCounter, run_distributed  # noqa: E402

ENCODER, LLM = dict(tp=2, dp=4), dict(tp=2, cp=2, dp=2)
MAX_IMAGES, MAX_TOKENS, BASE = 4, 512, 64
MODES = ("unbalanced", "balanced")


def long_tail_batch(cfg: MimoConfig, samples: int, seed: int) -> MimoBatch:
    """A ragged global batch: long-tail images, each image's placeholders one run at a
    random text gap (runs in order), loss on the text tokens."""
    gen = torch.Generator().manual_seed(seed)
    per, sizes = long_tail_images(gen, samples, max_images=MAX_IMAGES, max_tokens=MAX_TOKENS,
                                  base=BASE)  # fmt: skip
    s, token = cfg.seq_len, cfg.image_token_id
    ids = torch.randint(0, token, (samples, s), generator=gen)  # never the placeholder
    labels = torch.randint(0, cfg.vocab_size, (samples, s), generator=gen)
    mask = torch.ones(samples, s)
    k = 0
    for i, n in enumerate(per):
        mine, k = sizes[k : k + n], k + n
        cuts = torch.randint(0, s - sum(mine) + 1, (n,), generator=gen).sort().values.tolist()
        start, previous = 0, 0
        for size, cut in zip(mine, cuts):
            start += cut - previous
            previous = cut
            ids[i, start : start + size], mask[i, start : start + size] = token, 0.0
            start += size
    images = RaggedImages(torch.randn(sum(sizes), cfg.patch_dim, generator=gen),
                          torch.tensor(sizes), torch.tensor(per))  # fmt: skip
    return MimoBatch(images, ids, labels, mask)


def _replica_tokens(batch: MimoBatch, replicas: int) -> list[list[int]]:
    """Each encoder DP replica's per-image token counts (its contiguous samples)."""
    per = batch.images.images_per_sample.tolist()
    sizes, b, out, k = batch.images.tokens_per_image.tolist(), len(per) // replicas, [], 0
    for d in range(replicas):
        n = sum(per[d * b : (d + 1) * b])
        out.append(sizes[k : k + n])
        k += n
    return out


def _bounds(model, batch, plan, replica: int, llm_rows: slice, balanced: bool):
    """``(patch_rows, feature_rows)`` this rank must receive at least/most (module doc)."""
    tokens = _replica_tokens(batch, ENCODER["dp"])
    starts, g = [], 0  # g of each image's first token, replica-major = sample order
    for ts in tokens:
        starts.append(_cumulative(g, ts))
        g += sum(ts)
    held: set[int] = set()
    patch = 0
    for d, ts in enumerate(tokens):
        for j, t in enumerate(ts):
            dest = plan.dest[d][j] if balanced else d
            if dest == replica:
                held |= set(range(starts[d][j], starts[d][j] + t))
                patch += t if d != replica else 0
    ids = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    ids[batch.input_ids == model.image_token_id] = torch.arange(g)
    local = model.partition.shard(None, input_ids=ids[llm_rows]).input_ids
    needed = set(local[local >= 0].tolist())
    return patch, len(needed - held) + len(held - needed)


def _cumulative(g: int, ts: list[int]) -> list[int]:
    out = []
    for t in ts:
        out.append(g)
        g += t
    return out


class EncoderClock:
    """Thread CPU and wall seconds of the encoder's forward and backward inside a step."""

    def __init__(self, model) -> None:
        self.cpu = self.wall = 0.0
        self._start = (0.0, 0.0)
        model.encoder.register_forward_pre_hook(lambda *_: self._begin())
        model.projection.register_forward_hook(self._forward_done)
        model.encoder.patch_embed.weight.register_post_accumulate_grad_hook(lambda _: self._end())

    def _begin(self) -> None:
        self._start = (time.thread_time(), time.perf_counter())

    def _end(self) -> None:
        self.cpu += time.thread_time() - self._start[0]
        self.wall += time.perf_counter() - self._start[1]

    def _forward_done(self, _module, _inputs, out) -> None:
        self._end()
        if out.requires_grad:
            out.register_hook(self._backward_begins)

    def _backward_begins(self, grad: torch.Tensor) -> torch.Tensor:
        self._begin()
        return grad

    def reset(self) -> None:
        self.cpu = self.wall = 0.0


def _worker(cfg, batches, iters):
    rank = dist.get_rank()
    torch.manual_seed(0)
    enc_grid = make_grid(**ENCODER, create=("tp", "dp"))
    llm_grid = make_grid(**LLM, create=("tp", "cp", "dp", ("dp", "cp")))
    model = build_colocated_mimo(ReferenceMimo(cfg), enc_grid, llm_grid, flow="routed",
                                 balance=True)  # fmt: skip
    try:
        return _measure(model, cfg, batches, iters, rank, enc_grid, llm_grid)
    finally:
        destroy_colocated_mimo(model, enc_grid, llm_grid)


def _measure(model, cfg, batches, iters, rank, enc_grid, llm_grid) -> dict:
    balancer, clock = model.balancer, EncoderClock(model)
    enc_l, llm_l = GridLayout.from_grid(enc_grid), GridLayout.from_grid(llm_grid)
    replica, l_dp = enc_l.coords(rank)["dp"], llm_l.coords(rank)["dp"]
    per = batches[0].batch_size // llm_l.axis_size("dp")
    llm_rows = slice(l_dp * per, (l_dp + 1) * per)
    shards = []
    for b in batches:
        text = [dp_shard(t, l_dp, llm_l.axis_size("dp")) for t in b.text]
        shards.append((text, b.encoder_shard(replica, enc_l.axis_size("dp"))))

    def clear() -> None:
        balancer.cache.clear()
        model.bridge._route_cache.clear()

    def step(mode: str, k: int) -> tuple[float, float]:
        (ids, labels, mask), images = shards[k]
        model.balancer = balancer if mode == "balanced" else None
        clear()
        dist.barrier()
        cpu, wall = time.thread_time(), time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(ids, labels, mask, images).backward()
        model.sync_gradients()
        return time.thread_time() - cpu, time.perf_counter() - wall

    out: dict = {"rank": rank, "replica": replica}
    for mode in MODES:  # bytes: the whole step by collective, then the bridge pieces
        step(mode, 0)  # warm-up
        with CollectiveCounter() as c:
            step(mode, 0)
        out[f"{mode} step bytes"] = {k: c.bytes_received(k) for k in ("all_to_all", "all_gather",
                                                                      "all_reduce")}  # fmt: skip
    for k, b in enumerate(batches):
        (ids, *_), images = shards[k]
        clear()
        with CollectiveCounter() as c:
            rows, plan = balancer.balance(images.tokens, images.tokens_per_image)
        out[f"patch bytes {k}"] = c.bytes_received("all_to_all")
        out[f"own tokens {k}"] = int(images.tokens_per_image.sum())
        out[f"plan tokens after {k}"] = sum(plan.tokens_after(replica))
        for mode in MODES:
            balanced = mode == "balanced"
            patch, feat = _bounds(model, b, plan, replica, llm_rows, balanced)
            out[f"{mode} bound {k}"] = (patch * cfg.patch_dim * 4, feat * cfg.llm_hidden * 4)
            if balanced:
                sizes = torch.tensor(plan.tokens_after(replica))
                src = RaggedImages(rows, sizes, torch.ones(len(sizes), dtype=torch.int64))
            else:
                src = images
            x = model.projection(model.encoder(src)).detach().requires_grad_()
            extra = {"balance": plan} if balanced else {}
            with CollectiveCounter() as fwd:
                y = model.bridge.route(
                    x, tokens_per_sample=images.tokens_per_sample,
                    image_mask=ids == model.image_token_id, partition=model.partition, **extra,
                )  # fmt: skip
            with CollectiveCounter() as bwd:
                y.backward(torch.ones_like(y))
            out[f"{mode} route {k}"] = (
                fwd.bytes_received("all_to_all") + bwd.bytes_received("all_to_all"),
                fwd.bytes_received("all_gather"),
            )
        times = []  # plan: cold cache, count all-gather + planning; then the host plan alone
        for _ in range(3):
            clear()
            dist.barrier()
            t0 = time.perf_counter()
            balancer.plan(images.tokens, images.tokens_per_image)
            t1 = time.perf_counter()
            plan_balance(plan.tokens, c=cfg.encoder_cost_c)
            times.append((t1 - t0, time.perf_counter() - t1))
        out[f"plan {k}"] = tuple(statistics.median(t[i] for t in times) for i in (0, 1))
    runs = {m: [] for m in MODES}
    for i in range(iters):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            clock.reset()
            totals = [step(mode, k) for k in range(len(batches))]
            runs[mode].append((clock.cpu, clock.wall, *(sum(t[j] for t in totals) for j in (0, 1))))
    for mode in MODES:
        out[mode] = runs[mode]  # per iteration: enc cpu, enc wall, step cpu, step wall
    model.balancer = balancer
    return out


def _ratio(values) -> float:
    return max(values) / (sum(values) / len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=3, help="timed iterations per mode")
    p.add_argument("--batches", type=int, default=2, help="batches (seeds 0..) per iteration")
    p.add_argument("--samples", type=int, default=4, help="samples per encoder DP replica")
    p.add_argument("--enc-layers", type=int, default=6)
    p.add_argument("--enc-hidden", type=int, default=384, help="encoder hidden (FFN 4x)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")  # megatron's optional-dependency notices, per rank
    cfg = dataclasses.replace(
        MimoConfig(), patch_dim=64, num_patches=MAX_TOKENS, enc_hidden=args.enc_hidden,
        enc_heads=8, enc_ffn=4 * args.enc_hidden, enc_layers=args.enc_layers, proj_hidden=256,
        llm_hidden=32, llm_heads=2, llm_ffn=128, llm_layers=1, vocab_size=256,
        seq_len=MAX_IMAGES * MAX_TOKENS, image_token_id=255,
    )  # fmt: skip
    dp = ENCODER["dp"]
    batches = [long_tail_batch(cfg, args.samples * dp, seed) for seed in range(args.batches)]
    args.total_patch_bytes = sum(b.images.tokens.numel() * 4 for b in batches)
    os.environ["MP_BRIDGE_CHECK"] = "0"  # the library's default: no debug agreement checks
    start = time.perf_counter()
    print(f"command: PYTHONPATH=. python bench/encoder_balance.py {' '.join(sys.argv[1:])}")
    print(f"encoder {ENCODER} (h={cfg.enc_hidden}, ffn {cfg.enc_ffn}, {args.enc_layers} layers, "
          f"c={cfg.encoder_cost_c:g})"
          f" -> llm {LLM} (h=32, 1 layer), routed flow, S={cfg.seq_len}; long-tail images "
          f"max_images={MAX_IMAGES}, max_tokens={MAX_TOKENS}, base={BASE}; {args.samples} "
          f"samples per encoder replica, {args.batches} batches, {args.iters} iterations; "
          f"8 gloo ranks; load average before: {os.getloadavg()}", flush=True)  # fmt: skip
    for k, b in enumerate(batches):
        tokens = _replica_tokens(b, dp)
        plan = plan_balance(tokens, c=cfg.encoder_cost_c)
        print(f"batch {k}: tokens per replica {[sum(t) for t in tokens]} -> "
              f"{[sum(plan.tokens_after(d)) for d in range(dp)]}; images "
              f"{[len(t) for t in tokens]} -> {[len(plan.tokens_after(d)) for d in range(dp)]}; "
              f"{plan!r}")  # fmt: skip
    ranks = run_distributed(_worker, 8, cfg, batches, args.iters, timeout_s=1200)
    _report(ranks, args)
    print(f"load average after: {os.getloadavg()}; wall {time.perf_counter() - start:.0f} s")


def _report(ranks: list[dict], args) -> None:
    med = {m: [[statistics.median(it[j] for it in r[m]) for j in range(4)] for r in ranks]
           for m in MODES}  # fmt: skip
    rows = [("rank", "replica", "image tokens un/bal", "enc cpu ms unbal", "enc cpu ms bal",
             "enc wall ms unbal", "enc wall ms bal")]  # fmt: skip
    for r, u, b in zip(ranks, med["unbalanced"], med["balanced"]):
        k = range(args.batches)
        bal_tokens = sum(r[f"plan tokens after {i}"] for i in k)
        rows.append((str(r["rank"]), str(r["replica"]), f"{_own_tokens(r, args)}/{bal_tokens}",
                     f"{u[0] * 1e3:.0f}", f"{b[0] * 1e3:.0f}", f"{u[1] * 1e3:.0f}",
                     f"{b[1] * 1e3:.0f}"))  # fmt: skip
    print(format_table(rows))
    steps = {m: [max(r[m][i][3] for r in ranks) for i in range(args.iters)] for m in MODES}
    step = {m: statistics.median(steps[m]) for m in MODES}
    rows = [("mode", "enc cpu max/mean", "enc cpu max ms", "enc wall max/mean",
             "step wall ms (slowest rank)", "step cpu ms max rank", "modeled step ms",
             "patch KiB/rank max", "patch bound KiB", "feature KiB/rank max",
             "feature bound KiB", "route meta B", "bytes = bound", "plan ms (+gather)",
             "plan % of step (modeled / wall)")]  # fmt: skip
    k = range(args.batches)
    plan_all = max(sum(r[f"plan {i}"][0] for i in k) for r in ranks)
    plan_host = max(sum(r[f"plan {i}"][1] for i in k) for r in ranks)
    for m in MODES:
        cpu, wall = [v[0] for v in med[m]], [v[1] for v in med[m]]
        bal = m == "balanced"
        patch = [sum(r[f"patch bytes {i}"] for i in k) if bal else 0 for r in ranks]
        pbound = [sum(r[f"{m} bound {i}"][0] for i in k) for r in ranks]
        feat = [sum(r[f"{m} route {i}"][0] for i in k) for r in ranks]
        fbound = [sum(r[f"{m} bound {i}"][1] for i in k) for r in ranks]
        meta = max(sum(r[f"{m} route {i}"][1] for i in k) for r in ranks)
        exact = patch == pbound and feat == fbound
        rows.append((m, f"{_ratio(cpu):.2f}", f"{max(cpu) * 1e3:.0f}", f"{_ratio(wall):.2f}",
                     f"{step[m] * 1e3:.0f}", f"{max(v[2] for v in med[m]) * 1e3:.0f}",
                     f"{_modeled(med[m]) * 1e3:.0f}",
                     f"{max(patch) / 1024:.1f}", f"{max(pbound) / 1024:.1f}",
                     f"{max(feat) / 1024:.1f}", f"{max(fbound) / 1024:.1f}", str(meta),
                     "yes, every rank" if exact else "NO",
                     f"{plan_host * 1e3:.2f} ({plan_all * 1e3:.1f})" if bal else "",
                     f"{100 * plan_all / _modeled(med[m]):.2f} % / {100 * plan_all / step[m]:.2f} %"
                     if bal else ""))  # fmt: skip
    print(format_table(rows))
    u = [v[0] for v in med["unbalanced"]]
    b = [v[0] for v in med["balanced"]]
    cost = max(u) - max(b)
    saved = _modeled(med["unbalanced"]) - _modeled(med["balanced"])
    excess = max(u) - sum(u) / len(u)
    print(f"encoder imbalance cost (cpu): max - mean unbalanced {excess * 1e3:.0f} ms, max "
          f"unbalanced - max balanced {cost * 1e3:.0f} ms; modeled step saved "
          f"{saved * 1e3:.0f} ms; step wall saved: "
          f"{(step['unbalanced'] - step['balanced']) * 1e3:.0f} ms; per-iteration slowest-rank "
          f"steps ms: {[round(s * 1e3) for s in steps['unbalanced']]} vs "
          f"{[round(s * 1e3) for s in steps['balanced']]}")  # fmt: skip
    for m in MODES:
        print(f"{m} whole-step KiB received (max rank): " + ", ".join(
            f"{n} {max(r[f'{m} step bytes'][n] for r in ranks) / 1024:.1f}"
            for n in ("all_to_all", "all_gather", "all_reduce")))  # fmt: skip
    print(f"sum over ranks of patch rows moved <= tp x all image rows: "
          f"{sum(sum(r[f'patch bytes {i}'] for i in k) for r in ranks) / 1024:.1f} KiB <= "
          f"{ENCODER['tp'] * args.total_patch_bytes / 1024:.1f} KiB")  # fmt: skip


def _modeled(med: list[list[float]]) -> float:
    """A step with one core per rank: the slowest encoder, then the slowest rest (cpu)."""
    return max(v[0] for v in med) + max(v[2] - v[0] for v in med)


def _own_tokens(r: dict, args) -> int:
    return sum(r[f"own tokens {i}"] for i in range(args.batches))


if __name__ == "__main__":
    main()
