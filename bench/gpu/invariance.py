"""Stage (c) of the GPU runbook: ``invariant=True`` is bitwise the same at TP 1, 2, 4, 8.

Eight gloo ranks forked by ``mp_bridge.testing.run_distributed`` share one device (all on
``cuda:0``: NCCL refuses two ranks on one GPU; gloo carries the all-reduces and
all-gathers of CUDA tensors through host memory). Every rank builds the same full
problem from one seed; TP groups of 2, 4 and 8 consecutive ranks take the shards of the
block-aligned layout ``vocab_shard_ranges(V, tp, multiple=256)``; TP 1 is every rank's
own call on the caller's *unpadded* ``[V, H]`` weight / ``[N, V]`` logits, no group.

Checked, for fp32 and bf16 inputs, values and gradients (``torch.equal``; a difference
is shown with its largest absolute size):

- ``fused_ce_none`` / ``fused_ce_mean``: ``fused_linear_cross_entropy`` (label smoothing
  0.1, ignored tokens) on the ``"torch"`` engine, ``reduction="none"`` (recompute in
  backward) and ``"mean"`` (gradients made in forward); outputs, ``d hidden`` and this
  rank's ``d weight`` rows;
- ``fused_lp``: ``fused_linear_logprobs`` (temperature 0.8) with its entropy;
- ``triton_ce_none`` / ``triton_ce_mean`` / ``triton_lp``: the same three on the
  ``"triton"`` engine (issue 29; fixed-tile kernels, its own bits);
- ``mat_ce`` / ``mat_lp``: ``vocab_parallel_cross_entropy`` / ``vocab_parallel_logprobs``
  on materialized logits (one fp32 ``[N, V]`` product of the same inputs), ``d logits``.

Batch composition (TP 1 and 4; ``fused_ce_none``, ``triton_ce_none``, ``mat_lp``): the
same tokens with 90 unrelated tokens appended or prepended (upstream gradient 0 on them)
give the same values and ``d hidden`` rows, and, appended, the same ``d weight``. TP 1
fp32 values are also compared with ``F.cross_entropy`` in float64 on the full logits (a
sanity figure, not a bitwise claim).

    python bench/gpu/invariance.py --device cuda --out OUT/invariance.md

CPU smoke (the triton engine under Triton's interpreter, set below before ``triton`` is
first imported)::

    python bench/gpu/invariance.py --device cpu --n 70 --hidden 24 --vocab 2500 --out /tmp/inv.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():  # the triton engine's kernels on CPU: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mp_bridge.layers import (  # noqa: E402 - after TRITON_INTERPRET
    fused_linear_cross_entropy,
    fused_linear_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_logprobs,
    vocab_shard_ranges,
)
from mp_bridge.testing import run_distributed  # noqa: E402

WORLD = 8
TPS = (2, 4, 8)
FUSED = ("fused_ce_none", "fused_ce_mean", "fused_lp")  # the "torch" engine
TRITON = ("triton_ce_none", "triton_ce_mean", "triton_lp")  # the same on "triton"
CHECKS = (*FUSED, *TRITON, "mat_ce", "mat_lp")
BATCH_CHECKS = ("fused_ce_none", "triton_ce_none", "mat_lp")


def _problem(n: int, hidden: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 3
    t = torch.randint(0, vocab, (n,), generator=g)
    t[:: max(1, n // 7)] = -100  # some ignored tokens
    t[1] = vocab - 1  # the last real id (in the last, partial block)
    return h, w, t


def _run(check: str, h0, w0, z0, t, group, vocab: int, up):
    """One call of ``check`` with fresh leaves; ``(outputs..., grads...)`` detached."""
    tc = t.clamp(min=0)
    if not check.startswith("mat"):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        kw = {"tp_group": group, "vocab_size": vocab, "invariant": True, "chunk_size": 192}
        kw["engine"] = "triton" if check in TRITON else "torch"
        if check.endswith("_lp"):
            lp, ent = fused_linear_logprobs(h, w, tc, temperature=0.8, return_entropy=True, **kw)
            (lp * up + ent * up.flip(0)).sum().backward()
            outs = (lp, ent)
        else:
            red = "none" if check.endswith("ce_none") else "mean"
            out = fused_linear_cross_entropy(h, w, t, label_smoothing=0.1, reduction=red, **kw)
            (out * up).sum().backward() if red == "none" else out.backward()
            outs = (out,)
        return tuple(o.detach() for o in outs), (h.grad, w.grad)
    z = z0.clone().requires_grad_()
    kw = {"tp_group": group, "vocab_size": vocab, "invariant": True}
    if check == "mat_ce":
        out = vocab_parallel_cross_entropy(z, t, label_smoothing=0.1, **kw)
    else:
        out = vocab_parallel_logprobs(z, tc, temperature=0.8, **kw)
    (out * up).sum().backward()
    return (out.detach(),), (z.grad,)


def _cmp(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    if a.shape != b.shape:
        return False, float("inf")
    same = torch.equal(a, b)
    return same, 0.0 if same else (a.double() - b.double()).abs().max().item()


def _shard(x: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    """Rows/columns ``[start, end)`` of ``x`` along ``dim``, zero-padded past its end."""
    width, start = end - start, min(start, x.shape[dim])
    piece = x.narrow(dim, start, max(0, min(end, x.shape[dim]) - start))
    pad = list(x.shape)
    pad[dim] = width - piece.shape[dim]
    return torch.cat([piece, x.new_zeros(pad)], dim).contiguous()


def _rank(device: str, n: int, hidden: int, vocab: int, dtypes: tuple[str, ...], checks=CHECKS):
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's collective renames
    dev = torch.device(device)
    rank = dist.get_rank()
    groups = {}
    for tp in TPS:  # every rank creates every group, in the same order
        for first in range(0, WORLD, tp):
            g = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                groups[tp] = (g, rank - first)
    h32, w32, t = _problem(n, hidden, vocab)
    up = torch.linspace(0.5, 1.5, n).to(dev)
    t = t.to(dev)
    out: dict = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        h, w = h32.to(dev, dtype), w32.to(dev, dtype)
        mat = any(c.startswith("mat") for c in checks)  # [N, V] logits only when checked
        z = (h.float() @ w.float().t()).to(dtype) if mat else None
        for check in checks:
            ref_out, ref_grads = _run(check, h, w, z, t, None, vocab, up)
            if check == "mat_ce" and name == "float32":
                full = z.double().clone()
                oracle = F.cross_entropy(full, t, label_smoothing=0.1, reduction="none")
                out[("oracle", name)] = _cmp(ref_out[0].double(), oracle)[1]
            for tp in TPS:
                group, r = groups[tp]
                start, end = vocab_shard_ranges(vocab, tp, multiple=256)[r]
                is_fused = not check.startswith("mat")
                wl = _shard(w, 0, start, end) if is_fused else None
                zl = None if is_fused else _shard(z, 1, start, end)
                outs, grads = _run(check, h, wl, zl, t, group, vocab, up)
                pairs = list(zip(outs, ref_out))
                if is_fused:
                    pairs += [(grads[0], ref_grads[0])]
                    pairs += [(grads[1], _shard(ref_grads[1], 0, start, end))]
                else:
                    pairs += [(grads[0], _shard(ref_grads[0], 1, start, end))]
                res = [_cmp(a, b) for a, b in pairs]
                out[(check, name, tp)] = (all(s for s, _ in res), max(d for _, d in res))
        out.update(_batch(h, w, z, t, up, groups[4], vocab, name, checks))
    return out


def _batch(h, w, z, t, up, group_rank, vocab: int, name: str, checks=CHECKS) -> dict:
    """Base tokens alone vs with 90 unrelated tokens appended / prepended, TP 1 and 4."""
    hx, _, tx = _problem(90, h.shape[1], vocab, seed=7)
    hx, tx = hx.to(h.device, h.dtype), tx.to(h.device)
    zx = None if z is None else (hx.float() @ w.float().t()).to(z.dtype)
    n, res = h.shape[0], {}
    extra = {"h": hx, "z": zx, "t": tx, "up": up.new_zeros(90)}
    base = {"h": h, "z": z, "t": t, "up": up}
    for tp in (1, 4):
        group, r = (None, 0) if tp == 1 else group_rank
        start, end = vocab_shard_ranges(vocab, tp, multiple=256)[r]

        def local(x, dim, tp=tp, start=start, end=end):
            return x if tp == 1 else _shard(x, dim, start, end)

        for check in [c for c in BATCH_CHECKS if c in checks]:
            fused = not check.startswith("mat")
            wl = local(w, 0)
            zl = None if z is None else local(z, 1)
            b_out, b_grads = _run(check, h, wl, zl, t, group, vocab, up)
            for where in ("append", "prepend"):
                first, second = (base, extra) if where == "append" else (extra, base)
                cat = {k: torch.cat([first[k], second[k]]) for k in base if base[k] is not None}
                rows = slice(0, n) if where == "append" else slice(90, 90 + n)
                zc = None if z is None else local(cat["z"], 1)
                outs, grads = _run(check, cat["h"], wl, zc, cat["t"], group, vocab, cat["up"])
                pairs = [(outs[0][rows], b_out[0]), (grads[0][rows], b_grads[0])]
                if fused and where == "append":  # d weight: tiles summed in token order
                    pairs.append((grads[1], b_grads[1]))
                cmp = [_cmp(a, b) for a, b in pairs]
                res[("batch", check, name, tp, where)] = (
                    all(s for s, _ in cmp),
                    max(d for _, d in cmp),
                )
    return res


def _cell(results: list[dict], key) -> str:
    found = [r[key] for r in results if key in r]
    if not found:
        return "not run"
    if all(s for s, _ in found):
        return "bitwise"
    return f"**differs** (max abs {max(d for _, d in found):.3g})"


def _report(results: list[dict], dtypes, args, seconds: float) -> str:
    from report import markdown_table

    checks = args.checks
    rows = [(c, d, *(_cell(results, (c, d, tp)) for tp in TPS)) for d in dtypes for c in checks]
    lines = [
        "### Invariant mode: bitwise across TP on one device (stage c)\n",
        "command: `" + " ".join([os.path.basename(sys.executable), *sys.argv]) + "`\n",
        f"N={args.n} H={args.hidden} V={args.vocab} (V_local multiple of 256), 8 gloo ranks "
        f"on {args.device}; each cell compares TP k with TP 1 (values and gradients); "
        f"{seconds:.0f} s\n",
        markdown_table(("check", "inputs", *(f"TP {tp}" for tp in TPS)), rows),
        "\nBatch composition (90 unrelated tokens, upstream gradient 0 on them):\n",
    ]
    rows = [
        (c, d, tp, *(_cell(results, ("batch", c, d, tp, w)) for w in ("append", "prepend")))
        for d in dtypes
        for c in BATCH_CHECKS
        if c in checks
        for tp in (1, 4)
    ]
    lines.append(markdown_table(("check", "inputs", "TP", "appended", "prepended"), rows))
    oracle = [r[("oracle", "float32")] for r in results if ("oracle", "float32") in r]
    if oracle:
        lines.append(
            f"\nTP 1 fp32 `mat_ce` vs float64 `F.cross_entropy`: max abs {max(oracle):.3g}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="'cuda' (all ranks on cuda:0) or 'cpu'")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50000)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", required=True, help="markdown file to write")
    args = p.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    start = time.perf_counter()
    results = run_distributed(
        _rank,
        WORLD,
        device,
        args.n,
        args.hidden,
        args.vocab,
        tuple(args.dtypes),
        tuple(args.checks),
        backend="gloo",
        timeout_s=args.timeout,
    )
    text = _report(results, args.dtypes, args, time.perf_counter() - start)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    failed = [k for r in results for k, v in r.items() if k[0] != "oracle" and not v[0]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
