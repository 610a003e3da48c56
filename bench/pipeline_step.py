"""The colocated MIMO step with a pipelined LLM (LLM PP > 1) on 8 CPU (gloo) ranks.

    python bench/pipeline_step.py [--seq 512 --hidden 256 --batch 8 --microbatches 4
                                   --iters 5 --flow routed]

Model: ``MimoConfig`` with the LLM at ``--hidden`` (8 heads, FFN 4h, 4 layers so every
stage of PP = 4 holds one, vocab 256), a small encoder (hidden 128, 1 layer), sequence
``--seq``; ragged batch of ``--batch`` samples, one image each of ``1..seq/2`` tokens.
Layouts (encoder -> LLM, and the same LLM at PP = 1 on the same 8 ranks):

    tp2,dp4 -> tp2,pp2,dp2       vs  tp2,dp4
    tp1,dp8 -> tp1,cp2,pp2,dp2   vs  tp1,cp2,dp4
    tp2,dp4 -> tp2,pp4,dp1       vs  tp2,dp4

(a) **Image bytes per rank**, both flows: the delivery the pipelined step runs
(``route`` for the routed flow, ``communicate_ragged`` for the gather flow) called alone
on this rank's encoder output, forward and backward, bytes received by collective
(``CollectiveCounter``): "data" is the row exchange (``all_to_all``), "meta" the small
count all-gather, "CP AR" the gather flow's CP all-reduce of the consumed gradient. The
bound is computed here from the data contract alone (contiguous sample blocks per DP
index, the load-balanced CP cut: rank ``c`` keeps chunks ``c`` and ``2cp-1-c`` of
``2cp``, SP: piece ``tp`` of the local shard), not from the bridge's plan: forward, the
image rows a first-stage rank consumes and does not hold as an encoder rank (0 on a
later stage); backward, the rows it holds and did not consume (its whole encoder batch
on a later stage). A first-stage rank consumes its CP/SP shard's image rows (routed) or
its whole LLM DP batch's (gather). Cross-check: the ``all_to_all`` bytes of a whole
``train_step`` equal forward + backward data.

(b) **Stage-0 image rows** (computed from tensor sizes, fp32; not a measured process
peak, which on CPU cannot be attributed): the delivered rows tensor is held from the
encoder phase to the end of the schedule's backward, with its gradient (same size)
accumulating through the schedule: ``2 · rows · h · 4`` bytes, ``rows`` the measured
first dim of the tensor the delivery returned on that rank (it matches the bound's
consumed count). Compared with one microbatch's text activations on that rank:
hidden states ``[tokens per microbatch, h]`` (``b/M · S / cp``, ``/ tp`` with SP).

(c) **Step time**: ``zero_grad`` + ``train_step`` + ``sync_gradients`` of the pipelined
model (``--flow``, ``M`` microbatches) and of the same LLM at PP = 1 (same weights, same
global batch, one step over the LLM DP batch), alternating in one run with a barrier
before each; medians of the slowest rank over ``--iters`` steps (after one warm-up each);
spread = the largest per-rank interquartile range / median.
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

from mp_bridge.grid import GridLayout, make_grid  # noqa: E402
from mp_bridge.models import (  # noqa: E402
    MimoConfig,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    synthetic_batch,
)
from mp_bridge.table import format_table  # noqa: E402
from mp_bridge.testing import CollectiveCounter, run_distributed  # noqa: E402

LAYOUTS = [
    (dict(tp=2, dp=4), dict(tp=2, pp=2, dp=2), dict(tp=2, dp=4)),
    (dict(tp=1, dp=8), dict(tp=1, cp=2, pp=2, dp=2), dict(tp=1, cp=2, dp=4)),
    (dict(tp=2, dp=4), dict(tp=2, pp=4, dp=1), dict(tp=2, dp=4)),
]
CREATE = ("tp", "cp", "dp", ("dp", "cp"))


def _layout(d: dict) -> str:
    return ",".join(f"{k}{v}" for k, v in d.items())


def _local_positions(s: int, cp: int, c: int, tp: int, t: int, sp: bool) -> list[int]:
    """Sequence positions of one row that CP rank ``c`` (and with SP, TP rank ``t``) keeps."""
    chunk = s // (2 * cp)
    pos = [
        *range(c * chunk, (c + 1) * chunk),
        *range((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk),
    ]
    if sp and tp > 1:
        piece = len(pos) // tp
        pos = pos[t * piece : (t + 1) * piece]
    return pos


def _bound(batch, image_id: int, enc: dict, llm: dict, rank: int, sp: bool) -> dict:
    """Rows consumed / forward bound / backward bound of ``rank`` for both flows, from the
    data contract only (module docstring)."""
    enc_l = make_layout(enc)
    llm_l = make_layout(llm)
    e, c = enc_l.coords(rank), llm_l.coords(rank)
    b, s = batch.input_ids.shape
    row_ids = torch.full((b, s), -1, dtype=torch.long)
    image = batch.input_ids == image_id
    row_ids[image] = torch.arange(int(image.sum()))  # global image row, sample-major
    per_e = b // enc_l.axis_size("dp")
    held = set(row_ids[e["dp"] * per_e : (e["dp"] + 1) * per_e].flatten().tolist()) - {-1}
    per_l = b // llm_l.axis_size("dp")
    mine = row_ids[c["dp"] * per_l : (c["dp"] + 1) * per_l]
    cp, tp = llm_l.axis_size("cp"), llm_l.axis_size("tp")
    pos = _local_positions(s, cp, c.get("cp", 0), tp, c.get("tp", 0), sp)
    consumed = {
        "gather": set(mine.flatten().tolist()) - {-1},
        "routed": set(mine[:, pos].flatten().tolist()) - {-1},
    }
    out = {}
    for flow, rows in consumed.items():
        rows = rows if c.get("pp", 0) == 0 else set()
        out[flow] = dict(consumed=len(rows), fwd=len(rows - held), bwd=len(held - rows))
    out["local_tokens"] = per_l * len(pos)
    return out


def make_layout(sizes: dict) -> GridLayout:
    """The layout of ``make_grid(**sizes)`` on 8 ranks, without creating a group."""
    full = {k: sizes.get(k, 1) for k in ("tp", "cp", "pp", "dp")}
    return GridLayout(tuple(full.values()), tuple(full))


def _by_name(counter: CollectiveCounter) -> dict[str, int]:
    out: dict[str, int] = {}
    for call in counter.calls:
        out[call.name] = out.get(call.name, 0) + call.bytes_received
    return out


def _build(cfg, enc: dict, llm: dict, flow: str, m: int, sp: bool):
    torch.manual_seed(0)
    enc_grid = make_grid(**enc, create=("tp", "dp"))
    pp = llm.get("pp", 1) > 1
    llm_grid = make_grid(**llm, create=(*CREATE, *(("pp",) if pp else ())))
    model = build_colocated_mimo(
        ReferenceMimo(cfg), enc_grid, llm_grid, sequence_parallel=sp, flow=flow,
        microbatches=m if pp else 1,
    )  # fmt: skip
    return model, enc_grid, llm_grid


def _inputs(batch, enc_grid, llm_grid):
    rank = dist.get_rank()
    enc_l, llm_l = GridLayout.from_grid(enc_grid), GridLayout.from_grid(llm_grid)
    images = batch.encoder_shard(enc_l.coords(rank)["dp"], enc_l.axis_size("dp"))
    text = batch.llm_shard(llm_l.coords(rank)["dp"], llm_l.axis_size("dp"))
    return images, text


def _delivery_bytes(model, images, text, flow: str) -> dict:
    """The pipelined step's delivery alone (forward + backward) on this rank's encoder
    output: bytes by collective each way and the delivered rows."""
    with torch.no_grad():
        enc = model.parts().encode(images)
    x = enc.clone().requires_grad_(True)
    with CollectiveCounter() as fwd:
        if flow == "routed":
            y = model.bridge.route(
                x, tokens_per_sample=images.tokens_per_sample,
                image_mask=text.input_ids == model.image_token_id, partition=model.partition,
            )  # fmt: skip
        else:
            y, _ = model.bridge.communicate_ragged(x, images.tokens_per_sample)
    with CollectiveCounter() as bwd:
        torch.autograd.backward(y, torch.ones_like(y))
    return dict(fwd=_by_name(fwd), bwd=_by_name(bwd), rows=y.shape[0])


def _layout_rows(cfg, batch, enc, llm, base, args) -> dict:
    rank = dist.get_rank()
    out = {"bound": _bound(batch, cfg.image_token_id, enc, llm, rank, args.sp)}
    out["stage"] = make_layout(llm).coords(rank).get("pp", 0)
    models = {
        "pp": _build(cfg, enc, llm, args.flow, args.microbatches, args.sp),
        "pp1": _build(cfg, enc, base, args.flow, 1, args.sp),
    }
    try:
        data = {k: _inputs(batch, g[1], g[2]) for k, g in models.items()}
        model = models["pp"][0]
        images, text = data["pp"]
        for flow in ("gather", "routed"):
            out[flow] = _delivery_bytes(model, images, text, flow)

        def step(key: str):
            net, (imgs, txt) = models[key][0], data[key]
            net.zero_grad(set_to_none=True)
            net.train_step(txt.input_ids, txt.labels, txt.loss_mask, imgs)
            net.sync_gradients()

        for key in models:
            step(key)  # warm-up
        with CollectiveCounter() as whole:
            step("pp")
        out["step_a2a"] = _by_name(whole).get("all_to_all", 0)
        times = {key: [] for key in models}
        for _ in range(args.iters):
            for key in models:
                dist.barrier()
                t0 = time.perf_counter()
                step(key)
                times[key].append(time.perf_counter() - t0)
        for key, ts in times.items():
            q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (0, 0, 0)
            out[f"{key}_t"] = statistics.median(ts)
            out[f"{key}_spread"] = (q3 - q1) / statistics.median(ts)
    finally:
        for net, eg, lg in models.values():
            destroy_colocated_mimo(net, eg, lg)
    return out


def _worker(cfg, batch, args):
    return [_layout_rows(cfg, batch, *lay, args) for lay in LAYOUTS]


def _kib(v: float) -> str:
    return f"{v / 1024:.1f}"


def _bytes_rows(per_rank, h: int) -> list[tuple[str, ...]]:
    rows = [
        (
            "layout (encoder -> llm)", "flow", "fwd data KiB (max)", "fwd bound KiB (max)",
            "bwd data KiB (max)", "bwd bound KiB (max)", "data - bound B (max fwd, bwd)",
            "meta B (max)", "CP AR KiB (max)", "later stages fwd KiB",
        )
    ]  # fmt: skip
    for i, (enc, llm, _) in enumerate(LAYOUTS):
        ranks = [r[i] for r in per_rank]
        for flow in ("gather", "routed"):
            got = [[r[flow][d].get("all_to_all", 0) for d in ("fwd", "bwd")] for r in ranks]
            want = [[r["bound"][flow][d] * h * 4 for d in ("fwd", "bwd")] for r in ranks]
            over = [max(g[d] - w[d] for g, w in zip(got, want)) for d in (0, 1)]
            meta = max(sum(r[flow][d].get("all_gather", 0) for d in ("fwd", "bwd")) for r in ranks)
            ar = max(r[flow]["bwd"].get("all_reduce", 0) for r in ranks)
            later = max((g[0] for g, r in zip(got, ranks) if r["stage"] > 0), default=0)
            rows.append(
                (
                    f"{_layout(enc)} -> {_layout(llm)}", flow,
                    _kib(max(g[0] for g in got)), _kib(max(w[0] for w in want)),
                    _kib(max(g[1] for g in got)), _kib(max(w[1] for w in want)),
                    f"{over[0]}, {over[1]}" + (" (= on every rank)" if got == want else ""),
                    str(meta), _kib(ar), _kib(later),
                )
            )  # fmt: skip
    return rows


def _memory_rows(per_rank, h: int, m: int) -> list[tuple[str, ...]]:
    rows = [
        (
            "layout", "stage-0 image rows + grad KiB, gather (max)", "routed (max)",
            "rows = consumed", "1 microbatch hidden [tok, h] KiB", "ratio gather", "ratio routed",
        )
    ]  # fmt: skip
    for i, (enc, llm, _) in enumerate(LAYOUTS):
        first = [r[i] for r in per_rank if r[i]["stage"] == 0]
        held = {f: max(2 * r[f]["rows"] * h * 4 for r in first) for f in ("gather", "routed")}
        act = max(r["bound"]["local_tokens"] // m * h * 4 for r in first)
        same = all(r[f]["rows"] == r["bound"][f]["consumed"] for r in first for f in held)
        rows.append(
            (
                f"{_layout(enc)} -> {_layout(llm)}", _kib(held["gather"]), _kib(held["routed"]),
                "yes" if same else "NO", _kib(act), f"{held['gather'] / act:.2f}x",
                f"{held['routed'] / act:.2f}x",
            )
        )  # fmt: skip
    return rows


def _time_rows(per_rank, args) -> list[tuple[str, ...]]:
    rows = [
        (
            "layout", f"PP step ms (M={args.microbatches})", "spread", "PP=1 llm",
            "PP=1 step ms", "spread", "PP / PP=1", "step a2a = fwd+bwd data",
        )
    ]  # fmt: skip
    for i, (enc, llm, base) in enumerate(LAYOUTS):
        ranks = [r[i] for r in per_rank]
        t = {k: max(r[f"{k}_t"] for r in ranks) for k in ("pp", "pp1")}
        sp = {k: max(r[f"{k}_spread"] for r in ranks) for k in ("pp", "pp1")}
        a2a = all(
            r["step_a2a"]
            == r[args.flow]["fwd"].get("all_to_all", 0) + r[args.flow]["bwd"].get("all_to_all", 0)
            for r in ranks
        )
        rows.append(
            (
                f"{_layout(enc)} -> {_layout(llm)}", f"{t['pp'] * 1e3:.0f}",
                f"{sp['pp'] * 100:.0f}%", _layout(base), f"{t['pp1'] * 1e3:.0f}",
                f"{sp['pp1'] * 100:.0f}%", f"{t['pp'] / t['pp1']:.2f}x", "yes" if a2a else "NO",
            )
        )  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument(
        "--batch", type=int, default=8, help="global batch: divisible by 8 and by LLM DP x M"
    )
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--iters", type=int, default=5, help="timed steps per model")
    p.add_argument("--flow", choices=("routed", "gather"), default="routed")
    p.add_argument("--sp", action="store_true", help="sequence parallelism on the LLM")
    args = p.parse_args()
    warnings.filterwarnings("ignore")  # megatron's optional-dependency notices, per rank
    h, s = args.hidden, args.seq
    cfg = dataclasses.replace(
        MimoConfig(), patch_dim=64, num_patches=s // 2, enc_hidden=128, enc_heads=8,
        enc_ffn=256, proj_hidden=256, llm_hidden=h, llm_heads=8, llm_ffn=4 * h,
        llm_layers=4, vocab_size=256, seq_len=s, image_token_id=255,
    )  # fmt: skip
    batch = synthetic_batch(cfg, args.batch, seed=0, images_per_sample=(1, 1))
    n_img = int(batch.tokens_per_sample.sum())
    print(f"command: python bench/pipeline_step.py {' '.join(sys.argv[1:])}")
    print(
        f"S={s}, h={h} fp32, 4 LLM layers, global batch {args.batch}, M={args.microbatches}, "
        f"image tokens {n_img} of {args.batch * s} ({n_img / (args.batch * s):.0%}), "
        f"sp={args.sp}; 8 gloo ranks on {os.cpu_count()} cores; "
        f"load average before: {os.getloadavg()}",
        flush=True,
    )
    t0 = time.perf_counter()
    per_rank = run_distributed(_worker, 8, cfg, batch, args, timeout_s=1200)
    print("\n(a) image bytes received per rank by the delivery, vs the data-contract bound")
    print(format_table(_bytes_rows(per_rank, h)))
    print("\n(b) stage 0 holds every microbatch's image rows (fp32, from tensor sizes)")
    print(format_table(_memory_rows(per_rank, h, args.microbatches)))
    print(f"\n(c) step time, flow={args.flow}, {args.iters} alternating steps per model")
    print(format_table(_time_rows(per_rank, args)))
    print(f"\nwall {time.perf_counter() - t0:.0f} s; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
