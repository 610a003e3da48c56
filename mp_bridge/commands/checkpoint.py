"""``mp-bridge checkpoint inspect PATH``: a checkpoint's format version, step, saved
layout and every key with its global shape and dtype (see
:func:`mp_bridge.checkpoint.describe.describe`). ``mp-bridge checkpoint export-hf CKPT
OUT``: the checkpoint of a model loaded from Hugging Face, at any saved layout, as an HF
LLaVA directory (:func:`mp_bridge.models.hf.export_hf`). Both read files only: no process
group."""

from __future__ import annotations

import argparse

from mp_bridge.checkpoint.describe import describe

__all__ = ["add_arguments", "run", "run_export_hf"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    inspect = sub.add_parser("inspect", help="print a checkpoint's layout and keys")
    inspect.add_argument("path", help="the checkpoint directory (what save() was given)")
    inspect.set_defaults(run=run)
    export = sub.add_parser("export-hf", help="write a checkpoint as an HF LLaVA directory")
    export.add_argument("checkpoint", help="a checkpoint of a model loaded with load_hf")
    export.add_argument("out", help="the HF directory to write (config.json, model.safetensors)")
    export.set_defaults(run=run_export_hf)


def run(args: argparse.Namespace) -> int:
    try:
        print(describe(args.path))
    except FileNotFoundError as exc:  # a bad PATH argument: one line, exit code 2
        raise ValueError(str(exc)) from exc
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    from mp_bridge.models.hf import export_hf

    export_hf(args.checkpoint, args.out)  # a bad path: ValueError, one line, exit code 2
    print(f"wrote {args.out} from the checkpoint at {args.checkpoint}")
    return 0
