"""The GEMM shapes behind the fused LM-head engines' layout choices (one process, fp32).

Two tables, each method taken in turn run by run (``--repeat`` rounds), process CPU time,
best and worst of the rounds, load average printed:

1. Default runner, logits of one chunk: ``W [V_local, H] @ h^T [H, C]`` for every chunk of
   ``N`` tokens, as one call per chunk versus slabs of ``S`` weight rows (``SLAB_ROWS`` in
   ``engines/torch_ops/default.py``), and the bits of the two compared.
2. Invariant runner, the three batched products of one group of ``BLOCK_GROUP`` blocks at
   token tiles of 64, 128 and 256 rows, the same FLOPs per row of the table: logits
   ``[G, T, H] x [G, H, B]``, d hidden ``[G, T, B] x [G, B, H]`` and d weight ``[G, B, H]
   += [G, B, T] x [G, T, H]``.

    .venv/bin/python bench/lm_head_gemm_shapes.py
    .venv/bin/python bench/lm_head_gemm_shapes.py --n 1024 --vocab 32768 --repeat 2   # quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from mp_bridge.layers.loss.blocks import BLOCK_GROUP, VOCAB_BLOCK


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _rounds(methods: dict, repeat: int) -> dict[str, list[float]]:
    """Every method once per round, in turn; returns the CPU seconds of each round."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            times[name].append(_cpu(fn))
    return times


def _logits_methods(n: int, h_dim: int, vocab: int, chunk: int, slabs: list[int]) -> dict:
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(n, h_dim, generator=g), torch.randn(vocab, h_dim, generator=g)
    out = torch.empty(vocab, chunk)
    chunks = [slice(s, s + chunk) for s in range(0, n - chunk + 1, chunk)]

    def run(slab: int):
        def fn():
            for rows in chunks:
                ht = h[rows].t()
                for v in range(0, vocab, slab):
                    torch.mm(w[v : v + slab], ht, out=out[v : v + slab])

        return fn

    one, first = torch.mm(w, h[:chunk].t()), torch.empty(vocab, chunk)
    for slab in slabs:  # the first chunk's logits, slab by slab, against one call
        for v in range(0, vocab, slab):
            torch.mm(w[v : v + slab], h[:chunk].t(), out=first[v : v + slab])
        same = torch.equal(first, one)
        print(f"slabs of {slab}: bits of a chunk {'equal' if same else 'DIFFER'} to one call")
    return {f"one call ({vocab} rows)": run(vocab)} | {f"slabs of {s}": run(s) for s in slabs}


def _tile_methods(h_dim: int, tiles: tuple[int, ...], rows: int) -> dict:
    """The invariant runner's three products, ``rows`` tokens' worth per method."""
    g = torch.Generator().manual_seed(1)
    grp, b = BLOCK_GROUP, VOCAB_BLOCK
    wb = torch.randn(grp, b, h_dim, generator=g)
    wbt = wb.transpose(1, 2)
    out = {}
    for t in tiles:
        reps = rows // t
        gg = torch.randn(grp, t, b, generator=g)
        hi = torch.randn(t, h_dim, generator=g).expand(grp, t, h_dim)
        acc = torch.zeros(grp, b, h_dim)
        part = torch.empty(grp, t, h_dim)
        z = torch.empty(grp, t, b)
        out[f"logits, tile {t}"] = lambda reps=reps, hi=hi, z=z: [
            torch.bmm(hi, wbt, out=z) for _ in range(reps)
        ]
        out[f"d hidden, tile {t}"] = lambda reps=reps, gg=gg, part=part: [
            torch.bmm(gg, wb, out=part) for _ in range(reps)
        ]
        out[f"d weight, tile {t}"] = lambda reps=reps, gg=gg, hi=hi, acc=acc: [
            acc.baddbmm_(gg.transpose(1, 2), hi) for _ in range(reps)
        ]
    return out


def _table(title: str, times: dict[str, list[float]]) -> None:
    print(f"\n{title}\n\n| method | best cpu s | worst cpu s |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.3f} | {max(ts):.3f} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096, help="tokens (table 1)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=65536, help="V_local (table 1)")
    p.add_argument("--chunk", type=int, default=128, help="chunk rows (table 1)")
    p.add_argument("--slabs", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--tile-rows", type=int, default=8192, help="tokens per method (table 2)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("command: python " + " ".join(["bench/lm_head_gemm_shapes.py", *sys.argv[1:]]))
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPU cores")
    print("load average at start: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    logits = _logits_methods(args.n, args.hidden, args.vocab, args.chunk, args.slabs)
    _table(
        f"Shard-engine logits, N = {args.n}, H = {args.hidden}, V_local = {args.vocab}, "
        f"chunks of {args.chunk}",
        _rounds(logits, args.repeat),
    )
    _table(
        f"Invariant-engine products, G = {BLOCK_GROUP}, B = {VOCAB_BLOCK}, H = {args.hidden}, "
        f"{args.tile_rows} tokens per row",
        _rounds(_tile_methods(args.hidden, (64, 128, 256), args.tile_rows), args.repeat),
    )
    print("\nload average at end: {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
