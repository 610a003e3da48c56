"""``mp-bridge demo``: train the tiny colocated MIMO model, then check it against one process.

Launches ``--world`` ranks itself on CPU (gloo, forked processes), or, when started by
``torchrun`` (``RANK``/``WORLD_SIZE`` set), runs in the launched processes (NCCL on GPUs).
Prints one progress line per step (step, loss, tokens/s), then trains the single-process
reference on the same data and prints a parity table; exits 1 when parity fails. Batches
are ragged by default (each sample 0..3 images of 1..num_patches tokens, some text-only;
``communicate_ragged`` moves them); ``--uniform`` trains on one image of ``num_patches``
tokens per sample instead. The model runs the routed step by default (``--flow routed``:
shard ids first, route each image token straight to its CP/SP shard); ``--flow gather``
runs the full-sequence flow (bridge to the whole LLM replica, then partition).
``--images long-tail`` draws a heavy-tailed number of images per sample and tokens per
image; ``--balance`` spreads the images over the encoder DP replicas before encoding and
prints each rank's encoder forward+backward time before and after balancing.

    mp-bridge demo --world 8 --encoder tp=2,dp=4 --llm tp=2,cp=2,dp=2 --steps 20

An LLM layout with a ``pp`` axis (``--llm tp=2,pp=2,dp=2 --microbatches 4``) runs the LLM
in pipeline stages over ``--microbatches`` microbatches (``ColocatedMimoModel.train_step``).
``--hf DIR`` trains a transformers LLaVA instead, against transformers (:mod:`.demo_hf`).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time

from mp_bridge.checks import check_int, check_positive_float
from mp_bridge.comm import plan_bridge, seq_len_divisor
from mp_bridge.commands.demo_checkpoint import add_checkpoint_arguments, prepare_checkpoints
from mp_bridge.commands.demo_hf import add_hf_argument, run_hf
from mp_bridge.commands.demo_plot import check_plot_target, plot_losses
from mp_bridge.commands.layout_flag import layout_from_flag
from mp_bridge.grid import GridLayout
from mp_bridge.table import format_table
from mp_bridge.testing import under_torchrun

__all__ = ["add_arguments", "format_parity_table", "run"]

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-5
IMAGES_PER_SAMPLE = (0, 3)  # ragged batches: images drawn per sample (synthetic_batch)
POOL = 4  # distinct synthetic batches, cycled over the steps
WEIGHT_RTOL = 1e-4
# Weights may instead agree within 1% of one Adam step (0.01 * lr) in absolute terms: see
# ParityReport.passed. 20 Adam steps amplify rounding in near-zero gradient elements (e.g.
# tp=6 -> tp=6 on 6 ranks: 4e-5 abs = 0.4% of a step, 1.5e-4 rel) while losses and
# first-step gradients agree to 1e-6; a wiring error moves whole tensors by ~lr per step.
WEIGHT_STEP_FRACTION = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world", type=int, help="number of ranks (default 8; under torchrun its WORLD_SIZE)"
    )
    parser.add_argument(
        "--encoder", help="encoder layout (tp, dp); default tp=2,dp=4 (tp=2,dp=WORLD/2)"
    )
    parser.add_argument(
        "--llm", help="LLM layout (tp, cp, pp, dp); default tp=2,cp=2,dp=2 (default_layouts)"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="microbatches per step of a pipelined LLM (an --llm with pp > 1); default 1",
    )
    parser.add_argument("--steps", type=int, help="Adam steps (default 20; --hf: 5)")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="global batch (default: 8, or the next multiple of the DP sizes and of the "
        "LLM dp times --microbatches)",
    )
    parser.add_argument("--lr", type=float, help="Adam learning rate (1e-2; --hf: 1e-3)")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="sequence parallelism in the LLM"
    )
    parser.add_argument(
        "--fused-loss", action="store_true", help="fused LM-head cross-entropy (no logits)"
    )
    parser.add_argument(
        "--uniform",
        action="store_true",
        help="one image of num_patches tokens per sample (default: ragged, 0..3 images of "
        "1..num_patches tokens per sample)",
    )
    flow_help = "'routed': partition first, route image tokens to their shards; 'gather': "
    flow_help += "full-sequence embeddings, then partition"
    parser.add_argument("--flow", choices=("routed", "gather"), default="routed", help=flow_help)
    modes, cp_help = ("all_gather", "ring", "a2a"), "LLM attention's K/V over CP (a2a: heads)"
    parser.add_argument("--cp-comm", choices=modes, default=modes[0], help=cp_help)
    parser.add_argument(
        "--images",
        choices=("ragged", "long-tail"),
        default="ragged",
        help="ragged batches: 'ragged' (default, 0..3 images per sample) or 'long-tail' "
        "(heavy-tailed images per sample and tokens per image)",
    )
    parser.add_argument(
        "--balance",
        action="store_true",
        help="balanced encoders: whole images to encoder DP replicas by estimated cost, "
        "then per-rank encoder time before/after",
    )
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of both loss curves")
    add_checkpoint_arguments(parser)
    add_hf_argument(parser)
    parser.set_defaults(run=run)


def default_layouts(world: int) -> tuple[str, str]:
    """The ``--encoder``/``--llm`` specs used when they are not given, for ``world`` ranks.

    A TP2 encoder fanning into a TP2 x CP2 LLM where the world allows it (8 ranks:
    ``tp=2,dp=4`` -> ``tp=2,cp=2,dp=2``); CP2 alone on an even world not divisible by 4
    (2 ranks: ``tp=2`` -> ``cp=2``); pure DP on an odd world.
    """
    enc_tp = 2 if world % 2 == 0 else 1
    if world % 4 == 0:
        llm = f"tp=2,cp=2,dp={world // 4}"
    elif world % 2 == 0:
        llm = f"cp=2,dp={world // 2}"
    else:
        llm = f"dp={world}"
    return f"tp={enc_tp},dp={world // enc_tp}", llm


def _validate(args: argparse.Namespace) -> tuple[GridLayout, GridLayout]:
    """Every check that can fail, before any process starts (ValueError with the fix).

    Fills in ``args.encoder``/``args.llm``/``args.batch_size`` when they were left out.
    """
    if args.world is None:
        args.world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 8
    check_int("--world", args.world, low=1)
    check_int("--steps", args.steps, low=1)
    args.microbatches = getattr(args, "microbatches", 1)  # a Namespace built without it
    check_int("--microbatches", args.microbatches, low=1)
    check_positive_float("--lr", args.lr, fix="e.g. --lr 1e-2")
    default_enc, default_llm = default_layouts(args.world)
    args.encoder = args.encoder or default_enc
    args.llm = args.llm or default_llm
    enc_layout = layout_from_flag("--encoder", args.encoder, args.world, ("tp", "dp"))
    llm_layout = layout_from_flag("--llm", args.llm, args.world, ("tp", "cp", "pp", "dp"))
    enc = {n: enc_layout.axis_size(n) for n in ("tp", "dp")}
    llm = {n: llm_layout.axis_size(n) for n in ("tp", "cp", "pp", "dp")}
    if args.microbatches > 1 and llm["pp"] == 1:
        raise ValueError(
            f"--microbatches {args.microbatches} needs a pipelined LLM: add a pp axis to "
            f"--llm (e.g. tp=2,pp=2,dp=2) or use --microbatches 1"
        )
    if (llm["pp"] > 1) and args.fused_loss:
        raise ValueError("--fused-loss is not supported with an --llm pp axis; drop one")
    mb_unit = llm["dp"] * args.microbatches  # every LLM DP batch splits into microbatches
    if args.batch_size is None:
        step = math.lcm(enc["dp"], mb_unit)
        args.batch_size = -(-8 // step) * step  # the smallest multiple of both DPs >= 8
    check_int("--batch-size", args.batch_size, low=1)
    if args.plot:
        check_plot_target(args.plot)
    images = getattr(args, "images", "ragged")  # a Namespace built by hand may lack it
    if getattr(args, "uniform", False) and images != "ragged":
        raise ValueError(f"--uniform and --images {images} exclude each other; pick one")
    # The written axis order is the grid's rank order, so nesting is checked on it.
    plan_bridge(enc_layout, llm_layout, src_name="encoder", dest_name="llm", pipeline=True)
    factor = seq_len_divisor(llm["cp"], llm["tp"], sequence_parallel=args.sequence_parallel)
    args.config = demo_config(
        encoder_tp=enc["tp"], llm_tp=llm["tp"], seq_factor=factor, llm_pp=llm["pp"]
    )
    args.config.check_tp(encoder_tp=enc["tp"], llm_tp=llm["tp"])  # holds by construction
    args.config.check_cp_comm(
        getattr(args, "cp_comm", "all_gather"), llm_tp=llm["tp"], llm_cp=llm["cp"]
    )
    for flag, dp in (("--encoder", enc["dp"]), ("--llm", llm["dp"])):
        if args.batch_size % dp:
            raise ValueError(
                f"--batch-size {args.batch_size} does not split over {flag} dp={dp}; "
                f"use a multiple of {dp}"
            )
    if args.batch_size % mb_unit:
        raise ValueError(
            f"--batch-size {args.batch_size} does not split into --llm dp={llm['dp']} "
            f"batches of --microbatches {args.microbatches}; use a multiple of {mb_unit}"
        )
    return enc_layout, llm_layout


def demo_config(*, encoder_tp: int = 1, llm_tp: int = 1, seq_factor: int = 2, llm_pp: int = 1):
    """The demo's ``MimoConfig``, widened only as far as the layout needs (pure).

    The default ``MimoConfig()`` when it fits (TP sizes dividing 8, sequence length 16
    divisible by ``seq_factor``, the LLM layout's ``seq_len_divisor``). Otherwise, for a
    TP size ``t`` that does not divide 8: ``heads = lcm(t, 2)``, the hidden size the next
    multiple of the heads, the FFN / projection widths the next multiple of ``t`` (TP 3:
    6 heads, hidden 18, FFN 33; TP 6: 6 heads, hidden 18, FFN 36), and the sequence
    length the next multiple of ``seq_factor``; at least ``llm_pp`` LLM layers (one block
    per pipeline stage). Sizes stay close to the default, so the parity
    tolerances keep their meaning (a wider model has more near-zero gradients, which
    Adam's normalization turns into larger relative weight differences).
    """
    import dataclasses

    from mp_bridge.models import MimoConfig

    base = MimoConfig()

    def up(value: int, step: int) -> int:
        return -(-value // step) * step

    def heads(default: int, tp: int) -> int:
        return default if default % tp == 0 else math.lcm(tp, 2)

    enc_heads, llm_heads = heads(base.enc_heads, encoder_tp), heads(base.llm_heads, llm_tp)
    return dataclasses.replace(
        base,
        enc_heads=enc_heads,
        enc_hidden=up(base.enc_hidden, enc_heads),
        enc_ffn=up(base.enc_ffn, encoder_tp),
        proj_hidden=up(base.proj_hidden, encoder_tp),
        llm_heads=llm_heads,
        llm_hidden=up(base.llm_hidden, llm_heads),
        llm_ffn=up(base.llm_ffn, llm_tp),
        seq_len=up(base.seq_len, seq_factor),
        llm_layers=max(base.llm_layers, llm_pp),
    )


def _worker(enc: GridLayout, llm: GridLayout, opts: dict):
    """Runs on every rank: train + oracle; rank 0 prints the progress lines."""
    import torch.distributed as dist

    from mp_bridge.models import run_parity, synthetic_batch
    from mp_bridge.models.colocated.encoder_times import encoder_times
    from mp_bridge.testing import current_device

    cfg = opts["config"]
    rank0 = dist.get_rank() == 0
    # A few different batches, cycled: the loss falls as the model memorizes them.
    ragged = None if opts["uniform"] else IMAGES_PER_SAMPLE
    kind = {"images": "long-tail"} if opts["long_tail"] else {"images_per_sample": ragged}
    seeds = [100 + POOL * opts["seed"] + i for i in range(POOL)]  # seed 0: 100..103
    batches = [synthetic_batch(cfg, opts["batch_size"], seed=s, **kind) for s in seeds]
    tokens = opts["batch_size"] * cfg.seq_len

    def progress(step: int, loss: float, seconds: float) -> None:
        if rank0:
            print(
                f"step {step + 1:3d}/{opts['steps']}  loss {loss:.6f}  "
                f"tokens/s {tokens / seconds:9.0f}  step {seconds * 1e3:8.1f} ms",
                flush=True,
            )

    report = run_parity(
        cfg, encoder_tp=enc.axis_size("tp"), encoder_dp=enc.axis_size("dp"),
        llm_tp=llm.axis_size("tp"), llm_cp=llm.axis_size("cp"), llm_dp=llm.axis_size("dp"),
        llm_pp=llm.axis_size("pp"), microbatches=opts["microbatches"],
        encoder_axis_names=enc.axis_names,
        llm_axis_names=llm.axis_names, sequence_parallel=opts["sequence_parallel"],
        fused_loss=opts["fused_loss"], batch=batches, steps=opts["steps"], lr=opts["lr"],
        device=current_device(), on_step=progress, flow=opts["flow"], balance=opts["balance"],
        seed=opts["seed"], hooks=opts["hooks"], cp_comm=opts["cp_comm"],
    )  # fmt: skip
    if not opts["balance"] or opts["uniform"]:
        return report, None
    return report, encoder_times(
        cfg, batches, encoder_tp=enc.axis_size("tp"), encoder_dp=enc.axis_size("dp"),
        axis_names=enc.axis_names, device=current_device(),
    )  # fmt: skip


def _run_in_torchrun(args, enc, llm, opts, worker=None):
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if world != args.world:
        raise ValueError(f"torchrun launched {world} ranks but --world is {args.world}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    return (worker or _worker)(enc, llm, opts), dist.get_rank() == 0


def format_parity_table(report, *, weight_atol: float = 0.0) -> str:
    """Distributed vs single-process: max abs / rel difference and the tolerance used."""
    steps, grad_tol = len(report.ref_losses), report.grad_tolerance(GRAD_RTOL, WEIGHT_RTOL)
    rows = [
        (f"loss ({steps} steps)", report.loss_max_abs, report.loss_max_rel, LOSS_RTOL, 0.0),
        (f"param grads (step {report.first_step + 1})", report.param_grad_max_abs,
         report.param_grad_max_rel, grad_tol, 0.0),
        ("encoder input grad", report.input_grad_max_abs, report.input_grad_max_rel,
         WEIGHT_RTOL, 0.0),
        ("weights (gathered)", report.weight_max_abs, report.weight_max_rel, WEIGHT_RTOL,
         weight_atol),
    ]  # fmt: skip
    cells = [("quantity", "max abs", "max rel", "tolerance", "ok")]
    for name, a, r, rtol, atol in rows:
        tol = f"rel {rtol:.0e}" + (f" or abs {atol:.0e}" if atol else "")
        cells.append((name, f"{a:.2e}", f"{r:.2e}", tol, "yes" if r <= rtol or a <= atol else "NO"))
    return format_table(cells)


def _passed(report, weight_atol: float) -> bool:
    return report.passed(
        loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL, grad_rtol=GRAD_RTOL, weight_atol=weight_atol
    )


def _batches(args: argparse.Namespace) -> str:
    if args.images == "long-tail":
        return f"long-tail (heavy-tailed images per sample, 1..{args.config.num_patches} tokens)"
    if args.uniform:
        return f"uniform ({args.config.num_patches} image tokens per sample)"
    lo, hi = IMAGES_PER_SAMPLE
    return f"ragged ({lo}..{hi} images of 1..{args.config.num_patches} tokens per sample)"


def run(args: argparse.Namespace) -> int:
    from mp_bridge.models import parse_flow

    if getattr(args, "hf", None):
        return run_hf(args, _validate, _run_in_torchrun)
    args.steps = 20 if args.steps is None else args.steps
    args.lr = 1e-2 if args.lr is None else args.lr
    (enc, llm), hooks = prepare_checkpoints(args, _validate)
    opts = {
        "seed": getattr(args, "seed", 0),
        "hooks": hooks,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "sequence_parallel": args.sequence_parallel,
        "fused_loss": args.fused_loss,
        "config": args.config,
        "uniform": args.uniform,
        "microbatches": args.microbatches,
        "long_tail": args.images == "long-tail",
        "balance": args.balance,
        "flow": parse_flow(args.flow),  # parsed once here; the workers get the object
        "cp_comm": getattr(args, "cp_comm", "all_gather"),
    }
    start = time.perf_counter()
    if under_torchrun():
        (report, times), printer = _run_in_torchrun(args, enc, llm, opts)
    else:
        from mp_bridge.testing import current_device, run_distributed

        print(
            f"launching {args.world} ranks (gloo, {current_device()}): encoder "
            f"{args.encoder} -> llm {args.llm}, {_batches(args)} batches, {args.flow} flow"
            + (", balanced encoders" if args.balance else ""),
            flush=True,
        )
        (report, times), printer = run_distributed(_worker, args.world, enc, llm, opts)[0], True
    if not printer:
        return 0 if _passed(report, WEIGHT_STEP_FRACTION * args.lr) else 1
    mean_s = sum(report.step_seconds) / len(report.step_seconds)
    n = min(POOL, len(report.ref_losses))
    first, last = report.ref_losses[:n], report.ref_losses[-n:]
    print(
        f"\ntrained {len(report.dist_losses)} steps, {report.tokens_per_step} tokens/step, "
        f"{report.tokens_per_step / mean_s:.0f} tokens/s mean; mean loss over the {n} "
        f"batches: first pass {sum(first) / n:.4f}, last pass {sum(last) / n:.4f}"
    )
    print(
        f"parity vs single-process oracle ({report.encoder} -> {report.llm}, "
        f"{_batches(args)} batches, {args.flow} flow{', balanced' if args.balance else ''}):\n"
    )
    print(format_parity_table(report, weight_atol=WEIGHT_STEP_FRACTION * args.lr))
    if times is not None:
        from mp_bridge.models.colocated.encoder_times import format_encoder_times

        print(f"\nencoder forward+backward per rank ({POOL} batches), before/after balancing:")
        print(format_encoder_times(times))
    if args.plot:
        plot_losses(report, args.plot)
        print(f"\nwrote {args.plot}")
    ok = _passed(report, WEIGHT_STEP_FRACTION * args.lr)
    print(f"\nparity {'OK' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s")
    if not ok:
        print(
            f"worst weight: {report.worst_weight}; worst step-1 gradient: "
            f"{report.worst_param_grad}",
            file=sys.stderr,
        )
    return 0 if ok else 1
