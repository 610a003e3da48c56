"""``mp-bridge plan``: the bridge plan between the encoder and LLM layouts (pure).

Prints the direction and scale of the colocated bridge, then one row per rank with its
encoder and LLM coordinates, its slot, its gather group and its LLM CP group. With an LLM
``pp`` axis it adds each rank's stage and the pieces it sends to / receives from whom
(only stage 0 consumes encoder rows). When the layouts cannot be bridged it prints the
coordinate table and fails with the plan's error.
"""

from __future__ import annotations

import argparse

from mp_bridge.comm import format_rank_table, plan_bridge
from mp_bridge.comm.bridge import plan_stage_delivery
from mp_bridge.commands.layout_flag import layout_from_flag

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=8, help="number of ranks (default 8)")
    parser.add_argument("--encoder", default="tp=2,dp=4", help="encoder layout, e.g. tp=2,dp=4")
    parser.add_argument(
        "--llm", default="tp=2,cp=2,dp=2", help="LLM layout, e.g. tp=2,cp=2,dp=2 or tp=2,pp=2,dp=2"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise ValueError(f"--world {args.world} must be >= 1")
    src = layout_from_flag("--encoder", args.encoder, args.world)
    dest = layout_from_flag("--llm", args.llm, args.world)
    print(f"world {args.world}: encoder {src!r} -> llm {dest!r}\n")
    try:
        plan = plan_bridge(src, dest, src_name="encoder", dest_name="llm", pipeline=True)
    except ValueError:
        # Show where every rank sits so the nesting error can be read against it.
        print(format_rank_table(src, dest, "encoder", "llm"))
        raise
    print(plan.describe())
    if plan.pp_size > 1:
        print("\n" + plan_stage_delivery(plan).describe())
    return 0
