"""One colocated MIMO training step, routed flow vs gather flow, on 8 CPU (gloo) ranks.

    python bench/mimo_step.py [--seq 1024 --hidden 384 --batch 4 --iters 5]

Model: ``MimoConfig`` with the LLM at ``--hidden`` (8 heads, FFN 4h, 1 layer, vocab 256),
a small encoder (hidden 128, 1 layer), sequence ``--seq``; ragged batch of ``--batch``
samples, one image each of ``1..seq/2`` tokens (about a quarter of the tokens are image
tokens). Encoder ``tp=2,dp=4`` into LLM ``tp=2,cp=2,dp=2`` and ``tp=2,cp=4,dp=1`` (both
FAN_IN), each with and without SP. One model per layout; its ``flow`` attribute is
switched between ``"routed"`` and ``"gather"`` (same weights, groups, data). A step is
``zero_grad`` + forward + backward + ``sync_gradients`` (the optimizer is the same for
both flows and left out). Per row, max over ranks:

- bytes received per rank by collective over the whole step (``CollectiveCounter``);
- bridge bytes: ``route`` (forward + backward) vs ``communicate_ragged`` + its CP
  all-reduce (forward + backward) on the same encoder output, against the exact bound:
  rows of the rank's local (CP, SP) shard it does not hold as an encoder rank (forward)
  plus rows it holds but did not consume (backward), times ``h·4`` bytes. The bound is
  computed here from the image positions and ``PartitionAdapter.shard`` of a token-id
  tensor, not from the route plan;
- memory (torch's CPU profiler over one step, forward + backward, op input shapes, fp32):
  "saved act" = distinct non-parameter storages autograd saves for backward (a
  ``saved_tensors_hooks`` count, the activation memory held at the end of forward);
  "largest alloc" = the largest single-op allocation (attention scores here);
  "largest [..,h]" = the largest hidden-wide activation or gradient (an op input ending
  in ``h`` whose shape is no parameter's); "full-seq [..,h] ops" = ops taking such a tensor
  with at least ``b·S`` rows (the LLM DP batch's full sequences: ``[b, S, h]``). Target
  for the routed flow: 0. (``h`` is chosen unlike every other width of the model, so a
  shape match is the hidden dim.)
- time: the two flows alternate step by step (a barrier before each), each step followed
  by the bridge alone (forward + backward, as for the bytes); medians of the slowest rank;
  spread = the largest per-rank interquartile range / median.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mp_bridge.grid import GridLayout, make_grid  # noqa: E402
from mp_bridge.models import (  # noqa: E402
    MimoConfig,
    ReferenceMimo,
    build_colocated_mimo,
    destroy_colocated_mimo,
    dp_shard,
    synthetic_batch,
)
from mp_bridge.table import format_table  # noqa: E402
from mp_bridge.testing import CollectiveCounter, run_distributed  # noqa: E402

ENCODER = dict(tp=2, dp=4)
LLMS = [dict(tp=2, cp=2, dp=2), dict(tp=2, cp=4, dp=1)]


def _buffers(step, tokens: int, hidden: int, params) -> tuple[int, int, int]:
    """Of ``step()`` (forward and backward), from torch's CPU profiler (op inputs, fp32):
    the largest single-op allocation, the largest hidden-wide activation/gradient
    (``[..., h]``, not a parameter's shape) and how many ops took a full-sequence one
    (``[..., h]`` with at least ``tokens = b·S`` rows: the LLM DP batch's full sequences)."""
    param_shapes = {tuple(p.shape) for p in params}
    with profile(record_shapes=True, profile_memory=True) as prof:
        step()
    largest, widest, full_seq = 0, 0, 0
    for e in prof.events():
        largest = max(largest, e.self_cpu_memory_usage)
        if e.name.startswith("autograd::engine"):
            continue  # the op inside is listed itself
        for shape in e.input_shapes or []:
            if len(shape) < 2 or shape[-1] != hidden or tuple(shape) in param_shapes:
                continue
            rows = math.prod(shape[:-1])
            widest = max(widest, rows * hidden * 4)
            full_seq += rows >= tokens
    return largest, widest, full_seq


def _names(counter: CollectiveCounter) -> dict[str, int]:
    """Bytes received by collective name."""
    out: dict[str, int] = {}
    for call in counter.calls:
        out[call.name] = out.get(call.name, 0) + call.bytes_received
    return out


def _saved_bytes(step, params) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``step()``."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def _bound_rows(model, batch, llm_rows, enc_layout, rank) -> int:
    """Exact bridge bound in rows: needed-not-held (forward) + held-not-needed (backward)."""
    counts = batch.tokens_per_sample.tolist()
    ids = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    ids[batch.input_ids == model.image_token_id] = torch.arange(sum(counts))
    local = model.partition.shard(None, input_ids=ids[llm_rows]).input_ids
    part = model.partition
    if part.sequence_parallel and part.tp_size > 1:
        piece = local.shape[1] // part.tp_size
        local = local.narrow(1, part.tp_rank * piece, piece)
    needed = set(local[local >= 0].tolist())
    per = batch.batch_size // enc_layout.axis_size("dp")
    dp = enc_layout.coords(rank)["dp"]
    held = set(range(sum(counts[: dp * per]), sum(counts[: (dp + 1) * per])))
    return len(needed - held) + len(held - needed)


def _layout_rows(cfg, batch, llm: dict, sp: bool, iters: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    enc_grid = make_grid(**ENCODER, create=("tp", "dp"))
    llm_grid = make_grid(**llm, create=("tp", "cp", "dp", ("dp", "cp")))
    model = build_colocated_mimo(
        ReferenceMimo(cfg), enc_grid, llm_grid, sequence_parallel=sp, flow="gather"
    )
    try:
        enc_l, llm_l = GridLayout.from_grid(enc_grid), GridLayout.from_grid(llm_grid)
        e_dp, l_dp = enc_l.coords(rank)["dp"], llm_l.coords(rank)["dp"]
        images = batch.encoder_shard(e_dp, enc_l.axis_size("dp"))
        text = [dp_shard(t, l_dp, llm_l.axis_size("dp")) for t in (batch.input_ids, batch.labels)]
        mask = dp_shard(batch.loss_mask, l_dp, llm_l.axis_size("dp"))
        per = batch.batch_size // llm_l.axis_size("dp")
        llm_rows = slice(l_dp * per, (l_dp + 1) * per)
        params = list(model.parameters())

        def step(flow: str):
            def run():
                model.flow = flow
                model.zero_grad(set_to_none=True)
                model(*text, mask, images).backward()
                model.sync_gradients()

            return run

        out = {"bound": _bound_rows(model, batch, llm_rows, enc_l, rank) * cfg.llm_hidden * 4}
        ids = text[0]
        with torch.no_grad():
            enc = model.encode(images)

        def bridge(flow: str):
            """The bridge alone, forward + backward, on this rank's encoder output."""

            def run():
                x = enc.clone().requires_grad_(True)
                if flow == "routed":
                    y = model.bridge.route(
                        x,
                        tokens_per_sample=images.tokens_per_sample,
                        image_mask=ids == model.image_token_id,
                        partition=model.partition,
                    )
                else:
                    y, _ = model.bridge.communicate_ragged(x, images.tokens_per_sample)
                y.backward(torch.ones_like(y))

            return run

        for flow in ("routed", "gather"):
            step(flow)()  # warm-up
            with CollectiveCounter() as c:
                step(flow)()
            out[f"{flow}_bytes"] = _names(c)
            with CollectiveCounter() as c:
                bridge(flow)()
            out[f"{flow}_bridge"] = _names(c)
            out[f"{flow}_saved"] = _saved_bytes(step(flow), params)
            out[f"{flow}_largest"], out[f"{flow}_wide"], out[f"{flow}_full"] = _buffers(
                step(flow), per * cfg.seq_len, cfg.llm_hidden, params
            )
        times = {f"{flow}_{what}": [] for flow in ("routed", "gather") for what in "tb"}
        for _ in range(iters):
            for flow in ("routed", "gather"):
                for what, fn in (("t", step(flow)), ("b", bridge(flow))):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times[f"{flow}_{what}"].append(time.perf_counter() - t0)
        for key, ts in times.items():
            q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (0, 0, 0)
            out[key] = statistics.median(ts)
            out[f"{key}_spread"] = (q3 - q1) / statistics.median(ts)
    finally:
        destroy_colocated_mimo(model, enc_grid, llm_grid)
    out["layout"] = ",".join(f"{k}={v}" for k, v in llm.items()) + (",sp" if sp else "")
    return out


def _worker(cfg, batch, iters):
    return [_layout_rows(cfg, batch, llm, sp, iters) for llm in LLMS for sp in (False, True)]


def _check_hidden_is_unique(h: int, s: int) -> None:
    """The memory columns find hidden-wide tensors by their last dim: ``h`` must differ
    from every other width a tensor of the step can end in (sequence lengths per CP/SP
    shard, attention's key length, FFN, encoder widths, vocab)."""
    tp = ENCODER["tp"]
    others = {s, s // 2, 4 * h, 128, 256, 64, h // 8}
    for llm in LLMS:
        others |= {s // llm["cp"], s // (2 * llm["cp"]), s // (llm["cp"] * llm["tp"]), s // tp}
    if h in others:
        raise SystemExit(
            f"--hidden {h} equals another width of the step (one of {sorted(others)}); the "
            "memory columns could not tell hidden-wide tensors apart: pick another --hidden "
            "(e.g. 1152 with --seq 4096)"
        )


def _kib(v: int) -> str:
    return f"{v / 1024:.0f}"


def _data(bridge: dict) -> int:
    """Bridge bytes other than the small metadata all-gather (tokens, gradients, CP AR)."""
    return sum(v for k, v in bridge.items() if k != "all_gather")


def _by_name(d: dict) -> str:
    return " ".join(f"{k} {_kib(v)}" for k, v in sorted(d.items()) if v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--batch", type=int, default=4, help="global batch (multiple of 4)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per flow")
    args = p.parse_args()
    warnings.filterwarnings("ignore")  # megatron's optional-dependency notices, per rank
    h, s = args.hidden, args.seq
    _check_hidden_is_unique(h, s)
    cfg = dataclasses.replace(
        MimoConfig(), patch_dim=64, num_patches=s // 2, enc_hidden=128, enc_heads=8,
        enc_ffn=256, proj_hidden=256, llm_hidden=h, llm_heads=8, llm_ffn=4 * h,
        llm_layers=1, vocab_size=256, seq_len=s, image_token_id=255,
    )  # fmt: skip
    batch = synthetic_batch(cfg, args.batch, seed=0, images_per_sample=(1, 1))
    n_img = int(batch.tokens_per_sample.sum())
    print(f"command: python bench/mimo_step.py {' '.join(sys.argv[1:])}")
    print(
        f"S={s}, h={h}, global batch {args.batch}, image tokens {n_img} of {args.batch * s} "
        f"({n_img / (args.batch * s):.0%}); encoder tp=2,dp=4; 8 gloo ranks; "
        f"load average before: {os.getloadavg()}",
        flush=True,
    )
    per_rank = run_distributed(_worker, 8, cfg, batch, args.iters, timeout_s=3000)
    rows = [
        (
            "llm layout", "flow", "step KiB/rank by collective (max)", "bridge data KiB",
            "bridge meta B", "bound KiB", "data/bound", "saved act MiB", "largest alloc MiB",
            "largest [..,h] MiB", "full-seq [..,h] ops", "step ms", "vs gather", "spread",
            "bridge ms", "vs gather", "spread",
        )
    ]  # fmt: skip
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        t = {k: max(r[k] for r in ranks) for k in ("routed_t", "gather_t", "routed_b", "gather_b")}
        for flow in ("routed", "gather"):
            names = {}
            for r in ranks:
                for k, v in r[f"{flow}_bytes"].items():
                    names[k] = max(names.get(k, 0), v)
            data = [_data(r[f"{flow}_bridge"]) for r in ranks]
            meta = max(r[f"{flow}_bridge"].get("all_gather", 0) for r in ranks)
            bound = max(r["bound"] for r in ranks)
            exact = all(d == r["bound"] for d, r in zip(data, ranks))
            rows.append(
                (
                    row["layout"],
                    flow,
                    _by_name(names),
                    f"{max(data) / 1024:.1f}",
                    str(meta),
                    f"{bound / 1024:.1f}",
                    f"{max(data) / bound:.2f}x" + (" (= on every rank)" if exact else ""),
                    f"{max(r[f'{flow}_saved'] for r in ranks) / 2**20:.1f}",
                    f"{max(r[f'{flow}_largest'] for r in ranks) / 2**20:.1f}",
                    f"{max(r[f'{flow}_wide'] for r in ranks) / 2**20:.2f}",
                    str(max(r[f"{flow}_full"] for r in ranks)),
                    *(
                        cell
                        for w in "tb"
                        for cell in (
                            f"{t[f'{flow}_{w}'] * 1e3:.{0 if w == 't' else 1}f}",
                            f"{t[f'{flow}_{w}'] / t[f'gather_{w}']:.2f}x",
                            f"{max(r[f'{flow}_{w}_spread'] for r in ranks) * 100:.0f}%",
                        )
                    ),
                )
            )
    print(format_table(rows))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
