"""Stage (d) of the GPU runbook: LM-head loss fwd+bwd time and peak memory, one GPU, TP 1.

``hidden [N, H]`` and ``weight [V, H]`` in bf16 (N x H x V = 8192 x 4096 x {131072,
262144} by default), one ``mean`` cross-entropy and its backward to both. Methods:

- ``materialized``: ``F.linear`` bf16 logits ``[N, V]``, ``F.cross_entropy`` on them in fp32;
- ``megatron``: the same logits, megatron-core's ``vocab_parallel_cross_entropy`` (a
  one-rank process group: it all-reduces even at TP 1);
- ``ours_default``: ``fused_linear_cross_entropy(engine="triton")`` (issue 29: cuBLAS
  fp32-output GEMMs over vocab slabs + Triton passes, fp32-accumulated logits);
- ``ours_invariant``: the same with ``invariant=True`` (fixed-tile Triton kernels);
- ``torch_default`` / ``torch_invariant``: the same two on ``engine="torch"`` (bf16
  upcast once: the engines issue 24 measured);
- ``ours_input``: ``engine="torch"`` with ``logits_precision="input"`` (bf16 matmuls;
  shown for reference, no target attached);
- ``liger``: Liger-Kernel's ``liger_fused_linear_cross_entropy(input, weight, target)``;
- ``cce``: Cut Cross-Entropy's ``linear_cross_entropy(e, c, targets)``.

Each method first runs once untimed (Triton compiles and autotunes there), then the
methods run in turn, the starting method rotating per round, as many rounds as the time
budget allows (``--rounds`` at most); time is the best round (CUDA synchronized wall
clock), peak memory the worst: ``max_memory_allocated`` during the call minus
``memory_allocated`` before it (the leaves and their ``.grad`` are freed before each
call, so the gradients count). A method that fails (missing package, out of memory) is
reported with its error and left out of later rounds. Never asserts on time.

Precision (after the timed rounds, ``--precision``, the default): one more call of each
method against float64 on the *same* bf16 inputs (``fp64_reference.py``: fp64 logits in token
chunks, exact products of the bf16 values): the loss's absolute error, the normwise
relative error ``|g - g64| / |g64|`` of ``d hidden`` and ``d weight``, and for our fused
methods the largest log-prob error over the tokens (``fused_linear_logprobs``; issue 29's
target: 1e-5).

Per-rank TP 8 (``--tp8``, the default): each shape again at ``V_local = V / 8`` rows, TP 1
(this rank's work of a TP 8 call, collectives excluded), for ``ours_default``,
``ours_invariant`` and ``liger``.

    python bench/gpu/speed.py --out OUT/speed.md --json OUT/speed.json --budget 240

CPU smoke (the triton engine under Triton's interpreter, set below before ``triton`` is
first imported)::

    python bench/gpu/speed.py --device cpu --n 96 --hidden 64 --vocab 2048 --dtype float32 \
        --methods materialized ours_default ours_invariant torch_default --rounds 1 --out /tmp/s.md
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import warnings
from importlib import metadata

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():  # the triton engine's kernels on CPU: the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fp64_reference import fp64_reference, rel_err  # noqa: E402 - a sibling (bench/gpu)

from mp_bridge.layers import (  # noqa: E402 - after TRITON_INTERPRET
    fused_linear_cross_entropy,
    fused_linear_logprobs,
)

METHODS = (
    "materialized",
    "megatron",
    "ours_default",
    "ours_invariant",
    "torch_default",
    "torch_invariant",
    "ours_input",
    "liger",
    "cce",
)
#: The methods of the per-rank TP 8 table.
TP8_METHODS = ("ours_default", "ours_invariant", "liger")


def _megatron(h, w, t):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as mcore_ce

    logits = F.linear(h, w).unsqueeze(1)  # [s, b=1, V]
    try:
        loss = mcore_ce(logits, t.unsqueeze(1), 0.0, tp_group=dist.group.WORLD)
    except TypeError:  # megatron-core without tp_group: its global TP group
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        loss = mcore_ce(logits, t.unsqueeze(1), 0.0)
    return loss.mean()


def _liger(h, w, t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h, w, t)


def _cce(h, w, t):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, t)


#: Our fused methods and their keyword arguments (the log-prob precision column runs the
#: same on ``fused_linear_logprobs``).
FUSED_KW = {
    "ours_default": dict(engine="triton"),
    "ours_invariant": dict(engine="triton", invariant=True),
    "torch_default": dict(engine="torch"),
    "torch_invariant": dict(engine="torch", invariant=True),
    "ours_input": dict(engine="torch", logits_precision="input"),
}


def _fused(kw: dict, h, w, t):
    return fused_linear_cross_entropy(h, w, t, **kw)


LOSSES = {
    "materialized": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t),
    "megatron": _megatron,
    **{m: functools.partial(_fused, kw) for m, kw in FUSED_KW.items()},
    "liger": _liger,
    "cce": _cce,
}


def _init_world(device: torch.device) -> None:
    """A one-rank world (file store, no port) for megatron-core's all-reduces."""
    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="gpu_check_"), "store")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one(method: str, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    """``(seconds, peak extra bytes or None)`` of one fwd+bwd of ``method``."""
    dev = h.device
    h.grad = w.grad = None
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    start = time.perf_counter()
    LOSSES[method](h, w, t).backward()
    _sync(dev)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(dev) - before if dev.type == "cuda" else None
    h.grad = w.grad = None
    return seconds, peak


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:160]


def precision(method: str, h, w, t, ref) -> dict:
    """``{"loss_err", "dh_rel", "dw_rel"}`` of one call of ``method`` against ``ref``, and
    for our fused methods ``"lp_err"``: the largest ``|log-prob - fp64|`` over the tokens
    (``fused_linear_logprobs`` with the same options)."""
    h.grad = w.grad = None
    loss = LOSSES[method](h, w, t)
    loss.backward()
    out = {
        "loss_err": abs(loss.item() - ref[0].item()),
        "dh_rel": rel_err(h.grad, ref[1]),
        "dw_rel": rel_err(w.grad, ref[2]),
    }
    h.grad = w.grad = None
    if method in FUSED_KW:
        with torch.no_grad():
            lp = fused_linear_logprobs(h, w, t, **FUSED_KW[method])
        out["lp_err"] = (lp.double() - ref[3]).abs().max().item()
    return out


def bench_shape(args, vocab: int, methods, deadline: float) -> dict:
    """``{method: {"seconds", "peak", "runs", "error"}}`` for one vocab size."""
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(vocab)
    dtype = getattr(torch, args.dtype)
    h = torch.randn(args.n, args.hidden, generator=g).to(dev, dtype).requires_grad_()
    w = (torch.randn(vocab, args.hidden, generator=g) * args.hidden**-0.5).to(dev, dtype)
    w.requires_grad_()
    t = torch.randint(0, vocab, (args.n,), generator=g).to(dev)
    res = {
        m: {"seconds": None, "peak": None, "runs": 0, "error": None, "precision": None}
        for m in methods
    }
    warm = {}
    for m in methods:  # warm-up: compile / autotune, and the cost of one round
        try:
            warm[m] = _one(m, h, w, t)[0]
        except Exception as exc:  # noqa: BLE001 - reported in the table
            res[m]["error"] = _error(exc)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    live = [m for m in methods if res[m]["error"] is None]
    round_s = sum(warm.get(m, 0.0) for m in live)
    for r in range(args.rounds if live else 0):
        if r and time.perf_counter() + 1.2 * round_s > deadline:
            break
        for m in live[r % len(live) :] + live[: r % len(live)]:
            if res[m]["error"] is not None:
                continue
            try:
                s, peak = _one(m, h, w, t)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res[m]["error"] = _error(exc)
                continue
            cur = res[m]
            cur["seconds"] = s if cur["seconds"] is None else min(cur["seconds"], s)
            if peak is not None:
                cur["peak"] = peak if cur["peak"] is None else max(cur["peak"], peak)
            cur["runs"] += 1
    if args.precision and live:
        ref = fp64_reference(h, w, t)
        for m in live:
            try:
                res[m]["precision"] = precision(m, h, w, t, ref)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                res[m]["error"] = res[m]["error"] or _error(exc)
        del ref
    del h, w, t
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _fmt(x: float | None, spec: str) -> str | None:
    return None if x is None else format(x, spec)


def predicted(args, vocab: int) -> dict[str, float]:
    """The roofline's *predicted* H200 ms of our two triton methods at this shape, TP 1
    (``bench/gpu/roofline.py``; bf16 and fp32, the dtypes it models)."""
    from roofline import predicted_ms

    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(args.dtype)
    return predicted_ms(args.n, args.hidden, vocab, dtype=dtype) if dtype else {}


def shape_report(args, vocab: int, res: dict, title: str | None = None) -> str:
    from report import Measure, markdown_table, speed_verdicts, verdict_lines

    base = res.get("ours_default", {})
    pred = predicted(args, vocab)
    rows = []
    for m, r in res.items():
        s, peak, prec = r["seconds"], r["peak"], r.get("precision") or {}
        rel_t = s / base["seconds"] if s and base.get("seconds") else None
        rel_m = peak / base["peak"] if peak and base.get("peak") else None
        p_ms = pred.get(m)
        rows.append(
            (
                m,
                _fmt(None if s is None else s * 1e3, ".1f"),
                _fmt(p_ms, ".1f"),
                _fmt(s * 1e3 / p_ms if s and p_ms else None, ".2f"),
                _fmt(rel_t, ".2f"),
                _fmt(None if peak is None else peak / 2**30, ".2f"),
                _fmt(rel_m, ".2f"),
                _fmt(prec.get("loss_err"), ".2e"),
                _fmt(prec.get("lp_err"), ".2e"),
                _fmt(prec.get("dh_rel"), ".2e"),
                _fmt(prec.get("dw_rel"), ".2e"),
                r["runs"],
                r["error"] or "",
            )
        )
    header = ("method", "fwd+bwd ms", "predicted ms", "measured / predicted", "x ours_default")
    header += ("peak GiB", "x ours_default")
    precision_cols = ("loss - fp64", "log-prob max err", "d hidden rel err", "d weight rel err")
    table = markdown_table((*header, *precision_cols, "timed runs", "error"), rows)
    measured = {
        m: Measure(r["seconds"], r["peak"] or 0) for m, r in res.items() if r["seconds"] is not None
    }
    title = title or f"N x H x V = {args.n} x {args.hidden} x {vocab}, {args.dtype}, TP 1"
    note = (
        "\n\npredicted: bench/gpu/roofline.py (H200, fixed rates, *predicted*, never measured)"
        if pred
        else ""
    )
    return (
        f"#### {title}\n\n{table}{note}\n\nTargets (as in report.py):\n\n"
        f"{verdict_lines(speed_verdicts(measured))}\n"
    )


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore")  # megatron's apex / Transformer Engine notes
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, nargs="+", default=[131072, 262144])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds at most; best kept")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for every shape")
    p.add_argument("--out", required=True, help="markdown file to write")
    p.add_argument("--json", help="raw results as JSON")
    p.add_argument("--precision", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--tp8", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    os.environ.setdefault("MP_BRIDGE_CHECK", "0")  # time the losses, not the debug checks
    start = time.perf_counter()
    dev = torch.device(args.device)
    if "megatron" in args.methods:
        _init_world(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    versions = ", ".join(
        f"{d} {_version(d)}"
        for d in ("torch", "triton", "megatron-core", "liger-kernel", "cut-cross-entropy")
    )
    from mp_bridge.layers.loss.engines.triton_ops.default import addmm_path

    head = (
        "### LM-head loss: speed and memory (stage d)\n\n"
        f"command: `{' '.join([os.path.basename(sys.executable), *sys.argv])}`\n\n"
        f"{name}; {versions}. Time: best of the timed runs (methods in turn, first method "
        "rotating); peak: worst extra bytes over the call, gradients included. The default "
        f"mode's d h product (checked once): `{addmm_path(dev.type)}`.\n"
    )
    if os.environ.get("TRITON_INTERPRET") == "1":
        head += "\nTRITON_INTERPRET=1: the triton engine's times are the interpreter's (a smoke).\n"
    print(head, flush=True)
    parts, raw = [head], {}
    # (vocab, methods, title): the TP 1 shapes, then this rank's share of a TP 8 call
    runs = [(v, args.methods, None) for v in args.vocab]
    if args.tp8:
        tp8 = [m for m in TP8_METHODS if m in args.methods]
        runs += [
            (v // 8, tp8, f"per-rank TP 8: N x H x V_local = {args.n} x {args.hidden} x "
             f"{v // 8} (V = {v}), {args.dtype}, collectives excluded")
            for v in args.vocab
        ]  # fmt: skip
    for i, (vocab, methods, title) in enumerate(runs):
        left = args.budget - (time.perf_counter() - start)
        deadline = time.perf_counter() + left / (len(runs) - i)
        res = bench_shape(args, vocab, methods, deadline)
        raw[f"{vocab}" if title is None else f"tp8_{vocab}"] = res
        parts.append(shape_report(args, vocab, res, title))
        print(parts[-1], flush=True)
        with open(args.out, "w") as f:  # after each shape: a killed stage keeps the first
            f.write("\n".join(parts))
        if args.json:  # merged with what earlier calls wrote (one call per shape)
            merged = {}
            if os.path.exists(args.json):
                with open(args.json) as f:
                    merged = json.load(f).get("results", {})
            merged.update({str(k): v for k, v in raw.items()})
            with open(args.json, "w") as f:
                json.dump({"device": name, "versions": versions, "results": merged}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
