"""``mp-bridge demo --hf DIR``: train a transformers LLaVA at any layout, check it against
transformers' own training.

Every rank builds the model from ``config_from_hf(DIR)`` (no full model on any rank),
fills its shards with ``load_hf`` and trains ``--steps`` Adam steps (default 5, ``--lr``
1e-3) on seeded synthetic HF batches (:func:`synthetic_llava_inputs`: 0..3 images per
sample, right padding, 4 batches cycled). Then the launcher (rank 0 under ``torchrun``)
trains ``LlavaForConditionalGeneration.from_pretrained(DIR)`` (fp32, eager attention) in
one process on the same global batches with the same Adam and prints the parity table
(:mod:`mp_bridge.models.hf.hf_parity`: losses per step, first-step gradients by HF name,
the pixel gradient, weights after); exits 1 when parity fails.

    mp-bridge hf tiny /tmp/llava --text qwen2 --vision clip
    mp-bridge demo --hf /tmp/llava --world 4 --encoder tp=2,dp=2 --llm tp=2,cp=2
"""

from __future__ import annotations

import argparse
import time

from mp_bridge.comm import seq_len_divisor
from mp_bridge.grid import GridLayout
from mp_bridge.table import format_table
from mp_bridge.testing import under_torchrun

__all__ = ["add_hf_argument", "format_hf_parity_table", "run_hf"]

STEPS, LR, SEQ_LEN, POOL = 5, 1e-3, 16, 4
_REFUSED = (
    ("uniform", "--uniform"),
    ("balance", "--balance"),
    ("save", "--save"),
    ("save_every", "--save-every"),
    ("resume", "--resume"),
)


def add_hf_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        metavar="DIR",
        help="train the transformers LLaVA in DIR (e.g. written by 'mp-bridge hf tiny') and "
        "compare with transformers' own model trained in one process; --steps defaults to "
        f"{STEPS}, --lr to {LR:g}",
    )


def _validate_hf(args: argparse.Namespace, validate) -> tuple[GridLayout, GridLayout]:
    """The demo's layout checks (``validate``), then the model's (ValueError with the fix)."""
    from mp_bridge.models.hf import config_from_hf

    for attr, flag in _REFUSED:
        if getattr(args, attr, None):
            raise ValueError(f"{flag} does not apply to --hf {args.hf}; drop {flag}")
    if getattr(args, "images", "ragged") != "ragged":
        raise ValueError(f"--images {args.images} does not apply to --hf; drop it")
    args.steps = STEPS if args.steps is None else args.steps
    args.lr = LR if args.lr is None else args.lr
    enc, llm = validate(args)  # world, layouts, batch size, microbatches, the bridge plan
    factor = seq_len_divisor(
        llm.axis_size("cp"), llm.axis_size("tp"), sequence_parallel=args.sequence_parallel
    )
    seq_len = -(-SEQ_LEN // factor) * factor
    cfg = config_from_hf(args.hf, seq_len=seq_len)
    cfg.check_tp(encoder_tp=enc.axis_size("tp"), llm_tp=llm.axis_size("tp"))
    cfg.check_cp_comm(
        getattr(args, "cp_comm", "all_gather"), llm_tp=llm.axis_size("tp"),
        llm_cp=llm.axis_size("cp"),
    )  # fmt: skip
    pp = llm.axis_size("pp")
    if pp > cfg.llm_layers:
        raise ValueError(
            f"--llm pp={pp} needs one text layer per stage; {args.hf} has {cfg.llm_layers}"
        )
    args.config = cfg
    return enc, llm


def _hf_worker(enc: GridLayout, llm: GridLayout, opts: dict):
    """Every rank: build, load, train; rank 0 gets every rank's results (else ``None``)."""
    import torch
    import torch.distributed as dist

    from mp_bridge.grid import make_grid
    from mp_bridge.models import build_colocated_mimo, destroy_colocated_mimo
    from mp_bridge.models.data.images import RaggedImages
    from mp_bridge.models.hf import hf_batch, load_hf
    from mp_bridge.models.parallel.sharding import gather_full_state
    from mp_bridge.testing import current_device

    cfg, device, rank = opts["config"], current_device(), dist.get_rank()
    sizes = {n: llm.axis_size(n) for n in ("tp", "cp", "pp", "dp")}
    enc_grid = make_grid(
        tp=enc.axis_size("tp"), dp=enc.axis_size("dp"), axis_names=enc.axis_names,
        create=("tp", "dp"),
    )  # fmt: skip
    create = ("tp", "cp", "dp", ("dp", "cp"), *(("pp",) if sizes["pp"] > 1 else ()))
    llm_grid = make_grid(**sizes, axis_names=llm.axis_names, create=create)
    model = build_colocated_mimo(
        cfg, enc_grid, llm_grid, sequence_parallel=opts["sequence_parallel"],
        fused_loss=opts["fused_loss"], device=device, flow=opts["flow"],
        microbatches=opts["microbatches"], cp_comm=opts["cp_comm"],
    )  # fmt: skip
    try:
        load_hf(opts["hf"], model)
        enc_dp = GridLayout.from_grid(enc_grid).coords(rank)["dp"]
        llm_dp = GridLayout.from_grid(llm_grid).coords(rank)["dp"]
        local = []
        for ids, pixels, mask, labels in opts["batches"]:
            b = hf_batch(cfg, ids, pixels, labels, mask).to(device)
            local.append(
                (b.encoder_shard(enc_dp, enc.axis_size("dp")), b.llm_shard(llm_dp, sizes["dp"]))
            )
        optim = torch.optim.Adam(model.parameters(), lr=opts["lr"])
        losses, tokens = [], opts["batch_size"] * cfg.seq_len
        for step in range(opts["steps"]):
            start = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            images, text = local[step % len(local)]
            ragged = isinstance(images, RaggedImages)
            x = (images.tokens if ragged else images).clone().requires_grad_(True)
            images = images.with_tokens(x) if ragged else x
            loss = model.train_step(text.input_ids, text.labels, text.loss_mask, images)
            model.sync_gradients()
            optim.step()
            seconds = time.perf_counter() - start
            losses.append(loss.item())
            if step == 0:  # synced, before Adam's normalization hides their scale
                grads = {k: v.cpu() for k, v in gather_full_state(model, grads=True).items()}
                input_grad = x.grad.detach().cpu()
            if rank == 0:
                print(
                    f"step {step + 1:3d}/{opts['steps']}  loss {losses[-1]:.6f}  tokens/s "
                    f"{tokens / seconds:9.0f}  step {seconds * 1e3:8.1f} ms",
                    flush=True,
                )
        full = {k: v.cpu() for k, v in model.to_full().items()}
    finally:
        destroy_colocated_mimo(model, enc_grid, llm_grid)
    # A pipelined LLM's rank holds its own stage's LLM tensors: merge every rank's.
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((grads, full, enc_dp, input_grad), parts, dst=0)
    if rank != 0:
        return None
    merged = {"losses": losses, "grads": {}, "weights": {}, "input_grads": {}}
    for g, w, dp_rank, x_grad in parts:
        merged["grads"].update(g)
        merged["weights"].update(w)
        merged["input_grads"][dp_rank] = x_grad
    return merged


def format_hf_parity_table(parity) -> str:
    """A :class:`~mp_bridge.models.hf.hf_parity.TransformersParity` as the demo's table."""
    cells = [("quantity", "max abs", "max rel", "tolerance", "ok")]
    for name, a, r, tol, ok in parity.checks():
        cells.append((name, f"{a:.2e}", "-" if r != r else f"{r:.2e}", tol, "yes" if ok else "NO"))
    return format_table(cells)


def run_hf(args: argparse.Namespace, validate, in_torchrun) -> int:
    """``mp-bridge demo --hf``: see the module. ``validate``: the demo's layout checks;
    ``in_torchrun(args, enc, llm, opts, worker)``: the demo's ``torchrun`` entry."""
    from mp_bridge.commands.demo_plot import plot_losses
    from mp_bridge.models import parse_flow
    from mp_bridge.models.hf.hf_parity import compare_with_transformers, train_transformers
    from mp_bridge.models.hf.hf_synthetic import synthetic_llava_inputs

    enc, llm = _validate_hf(args, validate)
    cfg, seed = args.config, getattr(args, "seed", 0)
    seeds = [100 + POOL * seed + i for i in range(POOL)]
    batches = [synthetic_llava_inputs(cfg, args.batch_size, seed=s) for s in seeds]
    opts = {
        "hf": args.hf, "config": cfg, "batches": batches, "steps": args.steps, "lr": args.lr,
        "batch_size": args.batch_size, "sequence_parallel": args.sequence_parallel,
        "fused_loss": args.fused_loss, "flow": parse_flow(args.flow),
        "microbatches": args.microbatches, "cp_comm": getattr(args, "cp_comm", "all_gather"),
    }  # fmt: skip
    what = (
        f"{args.hf} ({cfg.llm_layers}-layer text, {cfg.enc_layers}-layer vision), encoder "
        f"{args.encoder} -> llm {args.llm}, {args.flow} flow, ragged HF batches (0..3 images "
        f"of {cfg.placeholders_per_image} placeholders per sample, right-padded, seq {cfg.seq_len})"
    )
    start = time.perf_counter()
    if under_torchrun():
        result = in_torchrun(args, enc, llm, opts, _hf_worker)[0]
    else:
        from mp_bridge.testing import current_device, run_distributed

        print(f"launching {args.world} ranks (gloo, {current_device()}): {what}", flush=True)
        result = run_distributed(_hf_worker, args.world, enc, llm, opts)[0]
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    print(
        f"\ntraining transformers' LlavaForConditionalGeneration in one process ({args.steps} "
        f"Adam steps, lr {args.lr:g}, the same {args.batch_size}-sample batches)",
        flush=True,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar
    run = train_transformers(args.hf, batches, steps=args.steps, lr=args.lr)
    parity = compare_with_transformers(
        cfg, run, losses=result["losses"], first_grads=result["grads"],
        weights=result["weights"], input_grads=result["input_grads"], first_batch=batches[0],
        encoder_dp=enc.axis_size("dp"), encoder=args.encoder, llm=args.llm,
    )  # fmt: skip
    losses = ", ".join(f"{a:.6f}/{b:.6f}" for a, b in zip(parity.dist_losses, parity.ref_losses))
    print(f"losses (ours/transformers): {losses}")
    print(f"parity vs transformers ({args.encoder} -> {args.llm}):\n")
    print(format_hf_parity_table(parity))
    if args.plot:
        plot_losses(parity, args.plot)
        print(f"\nwrote {args.plot}")
    ok = parity.passed()
    print(f"\nparity {'OK' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s")
    if parity.unmatched:
        print(f"HF gradients with no tensor of ours: {parity.unmatched}")
    return 0 if ok else 1
